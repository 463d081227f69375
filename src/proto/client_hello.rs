//! STUB until the real module lands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientHello {
    pub sni: Option<String>,
    pub alpn: Vec<String>,
    pub ech: bool,
}
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parse {
    Done { hello: ClientHello, len: usize },
    NeedMore,
    NotTls,
    Malformed(&'static str),
}
pub const MAX_HELLO_LEN: usize = 16 * 1024;
pub fn parse(buf: &[u8]) -> Parse {
    if buf.first() == Some(&0x16) {
        Parse::NeedMore
    } else {
        Parse::NotTls
    }
}
