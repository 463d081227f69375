use super::guard::{Limits, Step};
use super::target::Host;
pub struct HttpGuard;
impl HttpGuard {
    pub fn new(_h: Host, _p: u16, _l: Limits) -> Self { HttpGuard }
    pub fn client(&mut self, _h: &[u8]) -> Step { Step::NeedMore }
    pub fn server(&mut self, _b: &[u8]) {}
    pub fn requests(&self) -> u64 { 0 }
    pub fn first_host(&self) -> Option<&str> { None }
}
