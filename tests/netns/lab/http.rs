//! HTTP responses as tests see them, and a raw client connection driven byte by byte.

use super::*;

/// A parsed HTTP response (from curl or the raw client).
#[derive(Debug, Default, Clone)]
pub struct HttpResp {
    /// Status of the last response head seen (0 if none).
    pub status: u16,
    /// Headers of that response head, names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Exit status of the client tool.
    pub exit: Option<i32>,
    pub stderr: String,
    /// curl only: status of the CONNECT response (0 if no CONNECT).
    pub connect_status: u16,
    /// curl only: local port of the connection to the proxy.
    pub local_port: Option<u16>,
}

impl HttpResp {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parse one or more HTTP response heads; returns (status, headers) of the last.
pub(crate) fn parse_heads(text: &str) -> (u16, Vec<(String, String)>) {
    let mut status = 0;
    let mut headers = Vec::new();
    for line in text.split('\n') {
        let line = line.trim_end_matches('\r');
        if line.starts_with("HTTP/") {
            status = line
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            headers.clear();
        } else if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

/// A client connection to the proxy driven byte by byte by the test.
pub struct RawConn {
    pub stream: TcpStream,
    /// Received but not yet consumed.
    pub(super) buf: Vec<u8>,
    /// How the last read that ended a wait ended (EOF, or the error), for
    /// the message of a test that got no answer.
    pub(super) ended: Option<String>,
}

/// How a wait for the peer to close ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// EOF or reset after this long.
    After(Duration),
    /// Still open when the wait ended.
    StillOpen,
}

impl RawConn {
    /// A connection the test opened itself (from a bound source address,
    /// say).
    pub fn new(stream: TcpStream) -> RawConn {
        RawConn {
            stream,
            buf: Vec::new(),
            ended: None,
        }
    }

    pub fn local_port(&self) -> u16 {
        self.stream.local_addr().expect("local addr").port()
    }

    pub fn send(&mut self, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(data)?;
        self.stream.flush()
    }

    /// Read more bytes into the buffer before `deadline`.  Ok(0) on EOF;
    /// Err(TimedOut) at the deadline.
    pub(super) fn fill(&mut self, deadline: Instant) -> io::Result<usize> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(io::ErrorKind::TimedOut.into())
            }
            Err(e) => Err(e),
        }
    }

    /// Bytes up to and including `needle`, read within `timeout`; None on
    /// timeout or close (what was read stays buffered).
    pub fn read_until(&mut self, needle: &[u8], timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.buf.windows(needle.len()).position(|w| w == needle) {
                return Some(self.buf.drain(..i + needle.len()).collect());
            }
            match self.fill(deadline) {
                Ok(n) if n > 0 => {}
                Ok(_) => {
                    self.ended = Some("EOF".into());
                    return None;
                }
                Err(e) => {
                    self.ended = Some(format!("{:?}: {e}", e.kind()));
                    return None;
                }
            }
        }
    }

    /// Everything buffered so far (consumed).
    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Read one response head (status 0 if none arrives within `timeout`).
    pub fn read_head(&mut self, timeout: Duration) -> (u16, Vec<(String, String)>) {
        match self.read_until(b"\r\n\r\n", timeout) {
            Some(head) => parse_heads(&String::from_utf8_lossy(&head)),
            None => (0, Vec::new()),
        }
    }

    /// Read one response: head plus a Content-Length body.
    pub fn read_response(&mut self, timeout: Duration) -> HttpResp {
        let start = Instant::now();
        let deadline = start + timeout;
        let (status, headers) = self.read_head(timeout);
        if status == 0 {
            // Say which way no head came: a close or reset (the proxy
            // ended the exchange) or the whole wait (a slow machine).
            let waited = start.elapsed();
            let how = if waited < timeout.mul_f32(0.9) {
                "the connection was closed or reset"
            } else {
                "timed out"
            };
            return HttpResp {
                stderr: format!(
                    "no response head after {waited:?}: {how} ({}); buffered {:?}",
                    self.ended.as_deref().unwrap_or("?"),
                    String::from_utf8_lossy(&self.buf)
                ),
                exit: Some(0),
                ..HttpResp::default()
            };
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while self.buf.len() < len {
            match self.fill(deadline) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let body: Vec<u8> = self.buf.drain(..len.min(self.buf.len())).collect();
        HttpResp {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            exit: Some(0),
            ..HttpResp::default()
        }
    }

    /// Send `CONNECT target` and read the response head; the status.
    pub fn connect(&mut self, target: &str) -> u16 {
        self.send(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .expect("send CONNECT");
        self.read_head(Duration::from_secs(5)).0
    }

    /// Wait up to `timeout` for the peer to close (EOF or reset), discarding
    /// anything it sends meanwhile.
    pub fn wait_closed(&mut self, timeout: Duration) -> Closed {
        let start = Instant::now();
        let deadline = start + timeout;
        loop {
            self.buf.clear();
            match self.fill(deadline) {
                Ok(0) => return Closed::After(start.elapsed()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::TimedOut => return Closed::StillOpen,
                Err(_) => return Closed::After(start.elapsed()),
            }
        }
    }

    /// Close the connection (both directions).
    pub fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
