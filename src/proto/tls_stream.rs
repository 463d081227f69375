use super::client_hello::ClientHello;
use super::guard::Step;
use super::target::Host;
pub struct TlsGuard;
impl TlsGuard {
    pub fn new(_h: Host) -> Self { TlsGuard }
    pub fn client(&mut self, _h: &[u8]) -> Step { Step::NeedMore }
    pub fn server(&mut self, _b: &[u8]) {}
    pub fn hello(&self) -> Option<&ClientHello> { None }
}
