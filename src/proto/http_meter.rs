//! Where each HTTP/1.x request starts and ends in the bytes a client sends,
//! framed as hyper's server frames them (RFC 9112 §2.2, §6.3, §7.1), so that
//! evidence can count exactly the bytes each request took on the wire:
//! empty lines before it, request line, headers, and body with its chunk
//! framing. Pure: the caller feeds the bytes as they are read.
//!
//! hyper parses the same bytes first and refuses anything malformed by
//! closing the connection, so where this framer meets something it does
//! not understand it simply stops: no request after that is counted.

/// What a fed slice contained, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A complete request head of `len` bytes (leading empty lines included).
    Head { len: u64 },
    /// `n` more bytes of the current request's body, framing included.
    Body(u64),
}

/// The body that follows a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
}

/// Where in a chunked body the framer is (hyper's `ChunkedState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Start,
    Size(u64),
    SizeLws(u64),
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    EndCr,
    Trailer,
    TrailerLf,
    EndLf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Length(u64),
    Chunked(Chunk),
    /// After a CONNECT head: the bytes that follow are a tunnel's if the
    /// CONNECT is accepted, the next request's if not; held until told.
    Paused(Framing),
    Stopped,
}

/// Splits one connection's incoming bytes into requests.
#[derive(Debug)]
pub(crate) struct Framer {
    state: State,
    /// The head read so far, or the bytes held while paused.
    buf: Vec<u8>,
    max_head: usize,
}

impl Framer {
    /// `max_head`: the most bytes a head (or the bytes held after a
    /// CONNECT) may take before the framer gives up, as hyper does.
    pub(crate) fn new(max_head: usize) -> Framer {
        Framer {
            state: State::Head,
            buf: Vec::new(),
            max_head,
        }
    }

    /// Feed the next bytes read from the client.
    pub(crate) fn feed(&mut self, mut data: &[u8], events: &mut Vec<Event>) {
        let mut body = 0u64;
        while !data.is_empty() {
            match self.state {
                State::Stopped => break,
                State::Paused(_) => {
                    if self.buf.len() + data.len() > self.max_head {
                        self.stop();
                    } else {
                        self.buf.extend_from_slice(data);
                    }
                    break;
                }
                State::Head => {
                    let old = self.buf.len();
                    self.buf.extend_from_slice(data);
                    match head_end(&self.buf, old) {
                        Ok(Some(end)) => {
                            data = &data[end - old..];
                            self.buf.truncate(end);
                            let Some((connect, next)) = framing(&self.buf) else {
                                self.stop();
                                break;
                            };
                            flush_body(&mut body, events);
                            events.push(Event::Head { len: end as u64 });
                            self.buf.clear();
                            self.state = if connect {
                                State::Paused(next)
                            } else {
                                body_state(next)
                            };
                        }
                        Ok(None) if self.buf.len() <= self.max_head => break,
                        Ok(None) | Err(()) => {
                            self.stop();
                            break;
                        }
                    }
                }
                State::Length(rem) => {
                    let n = rem.min(data.len() as u64);
                    body += n;
                    data = &data[n as usize..];
                    self.state = if rem == n {
                        State::Head
                    } else {
                        State::Length(rem - n)
                    };
                }
                State::Chunked(Chunk::Data(rem)) => {
                    let n = rem.min(data.len() as u64);
                    body += n;
                    data = &data[n as usize..];
                    self.state = State::Chunked(if rem == n {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(rem - n)
                    });
                }
                State::Chunked(chunk) => {
                    body += 1;
                    self.state = match chunk_step(chunk, data[0]) {
                        Some(Some(next)) => State::Chunked(next),
                        Some(None) => State::Head,
                        None => State::Stopped,
                    };
                    data = &data[1..];
                }
            }
        }
        flush_body(&mut body, events);
    }

    /// The CONNECT just read was refused: what follows is the next request.
    pub(crate) fn resume(&mut self, events: &mut Vec<Event>) {
        if let State::Paused(next) = self.state {
            self.state = body_state(next);
            let held = std::mem::take(&mut self.buf);
            self.feed(&held, events);
        }
    }

    /// No more requests will be counted (a tunnel took the connection).
    pub(crate) fn stop(&mut self) {
        self.state = State::Stopped;
        self.buf = Vec::new();
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.state == State::Stopped
    }
}

fn flush_body(body: &mut u64, events: &mut Vec<Event>) {
    if *body > 0 {
        events.push(Event::Body(*body));
        *body = 0;
    }
}

fn body_state(body: Framing) -> State {
    match body {
        Framing::Length(0) => State::Head,
        Framing::Length(n) => State::Length(n),
        Framing::Chunked => State::Chunked(Chunk::Start),
    }
}

/// The end of the head in `buf`, searching from about `from` on: after any
/// empty lines before the request line (which httparse skips), the first
/// empty line, CRLF or bare LF. `Err` for a lone CR among those empty lines.
fn head_end(buf: &[u8], from: usize) -> Result<Option<usize>, ()> {
    let mut start = 0;
    loop {
        match buf.get(start) {
            Some(b'\n') => start += 1,
            Some(b'\r') => match buf.get(start + 1) {
                Some(b'\n') => start += 2,
                Some(_) => return Err(()),
                None => return Ok(None),
            },
            Some(_) => break,
            None => return Ok(None),
        }
    }
    let mut i = from.saturating_sub(2).max(start);
    while i < buf.len() {
        if buf[i] == b'\n' {
            match (buf.get(i + 1), buf.get(i + 2)) {
                (Some(b'\n'), _) => return Ok(Some(i + 2)),
                (Some(b'\r'), Some(b'\n')) => return Ok(Some(i + 3)),
                _ => {}
            }
        }
        i += 1;
    }
    Ok(None)
}

/// Parse a complete head as hyper does: is it a CONNECT, and what body
/// follows (RFC 9112 §6.3)? `None` where hyper refuses the request.
fn framing(head: &[u8]) -> Option<(bool, Framing)> {
    let lines = head.iter().filter(|&&b| b == b'\n').count();
    let mut headers = vec![httparse::EMPTY_HEADER; lines];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(len)) if len == head.len() => {}
        _ => return None,
    }
    let connect = req.method == Some("CONNECT");
    let http11 = req.version == Some(1);
    let (mut te, mut chunked, mut length) = (false, false, None);
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !http11 {
                return None;
            }
            te = true;
            length = None;
            chunked = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.rsplit(',').next())
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        } else if h.name.eq_ignore_ascii_case("content-length") && !te {
            let n = digits(h.value)?;
            if length.is_some_and(|prev| prev != n) {
                return None;
            }
            length = Some(n);
        }
    }
    match (te, chunked) {
        (true, true) => Some((connect, Framing::Chunked)),
        (true, false) => None,
        (false, _) => Some((connect, Framing::Length(length.unwrap_or(0)))),
    }
}

/// A Content-Length value: ASCII digits only (hyper's `from_digits`).
fn digits(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |n, &b| match b {
        b'0'..=b'9' => n.checked_mul(10)?.checked_add(u64::from(b - b'0')),
        _ => None,
    })
}

/// One byte of chunk framing: the next state, `Some(None)` at the end of
/// the body, `None` where hyper refuses it.
fn chunk_step(state: Chunk, b: u8) -> Option<Option<Chunk>> {
    let hex = |size: u64| -> Option<u64> {
        let d = (b as char).to_digit(16)?;
        size.checked_mul(16)?.checked_add(u64::from(d))
    };
    let next = match state {
        Chunk::Start => Chunk::Size(hex(0)?),
        Chunk::Size(size) => match b {
            b'\t' | b' ' => Chunk::SizeLws(size),
            b';' => Chunk::Extension(size),
            b'\r' => Chunk::SizeLf(size),
            _ => Chunk::Size(hex(size)?),
        },
        Chunk::SizeLws(size) => match b {
            b'\t' | b' ' => Chunk::SizeLws(size),
            b';' => Chunk::Extension(size),
            b'\r' => Chunk::SizeLf(size),
            _ => return None,
        },
        Chunk::Extension(size) => match b {
            b'\r' => Chunk::SizeLf(size),
            b'\n' => return None,
            _ => Chunk::Extension(size),
        },
        Chunk::SizeLf(size) => match b {
            b'\n' if size == 0 => Chunk::EndCr,
            b'\n' => Chunk::Data(size),
            _ => return None,
        },
        Chunk::Data(_) => return None,
        Chunk::DataCr => match b {
            b'\r' => Chunk::DataLf,
            _ => return None,
        },
        Chunk::DataLf => match b {
            b'\n' => Chunk::Start,
            _ => return None,
        },
        Chunk::EndCr => match b {
            b'\r' => Chunk::EndLf,
            _ => Chunk::Trailer,
        },
        Chunk::Trailer => match b {
            b'\r' => Chunk::TrailerLf,
            _ => Chunk::Trailer,
        },
        Chunk::TrailerLf => match b {
            b'\n' => Chunk::EndCr,
            _ => return None,
        },
        Chunk::EndLf => match b {
            b'\n' => return Some(None),
            _ => return None,
        },
    };
    Some(Some(next))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `input` in pieces of `step` bytes; the events, merged.
    fn run(input: &[u8], step: usize) -> (Vec<Event>, Framer) {
        let mut f = Framer::new(64 * 1024);
        let mut events = Vec::new();
        for piece in input.chunks(step) {
            f.feed(piece, &mut events);
        }
        (merge(events), f)
    }

    fn merge(events: Vec<Event>) -> Vec<Event> {
        let mut out: Vec<Event> = Vec::new();
        for e in events {
            match (out.last_mut(), e) {
                (Some(Event::Body(a)), Event::Body(b)) => *a += b,
                _ => out.push(e),
            }
        }
        out
    }

    fn head_len(s: &[u8]) -> u64 {
        s.windows(4).position(|w| w == b"\r\n\r\n").unwrap() as u64 + 4
    }

    fn every_split(input: &[u8], want: &[Event]) {
        for step in 1..=input.len() {
            let (got, _) = run(input, step);
            assert_eq!(got, want, "pieces of {step}");
        }
    }

    #[test]
    fn heads_and_bodies_of_pipelined_requests() {
        let get = b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\n\r\n";
        let post = b"POST http://a.test/ HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        let chunked = b"PUT http://a.test/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
                        5;ext=1\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n";
        let lf = b"\r\n\nGET http://a.test/ HTTP/1.1\nHost:  a.test  \n\n";
        let mut all = Vec::new();
        for part in [&get[..], post, chunked, lf] {
            all.extend_from_slice(part);
        }
        every_split(
            &all,
            &[
                Event::Head {
                    len: get.len() as u64,
                },
                Event::Head {
                    len: head_len(post),
                },
                Event::Body(5),
                Event::Head {
                    len: head_len(chunked),
                },
                Event::Body(chunked.len() as u64 - head_len(chunked)),
                Event::Head {
                    len: lf.len() as u64,
                },
            ],
        );
    }

    #[test]
    fn a_connect_holds_what_follows_until_told() {
        let connect = b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n";
        let next = b"GET http://a.test/ HTTP/1.1\r\n\r\n";
        let mut both = connect.to_vec();
        both.extend_from_slice(next);
        // refused: the next request is counted
        let (events, mut f) = run(&both, 7);
        assert_eq!(
            events,
            [Event::Head {
                len: connect.len() as u64
            }]
        );
        let mut events = Vec::new();
        f.resume(&mut events);
        assert_eq!(
            events,
            [Event::Head {
                len: next.len() as u64
            }]
        );
        // accepted: nothing more is looked at
        let (_, mut f) = run(&both, 100);
        f.stop();
        let mut events = Vec::new();
        f.feed(next, &mut events);
        assert!(events.is_empty() && f.is_stopped());
    }

    #[test]
    fn what_hyper_refuses_stops_the_count() {
        for bad in [
            &b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
            b"\rGET / HTTP/1.1\r\n\r\n",
        ] {
            let (events, f) = run(bad, bad.len());
            assert!(events.is_empty(), "{events:?}");
            assert!(f.is_stopped(), "{}", String::from_utf8_lossy(bad));
        }
        // Transfer-Encoding wins over Content-Length
        let te_cl =
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let (events, f) = run(te_cl, 1);
        assert_eq!(
            events,
            [
                Event::Head {
                    len: head_len(te_cl)
                },
                Event::Body(5)
            ]
        );
        assert!(!f.is_stopped());
        // a head larger than the limit
        let mut f = Framer::new(16);
        let mut events = Vec::new();
        f.feed(b"GET / HTTP/1.1\r\nHost: a.test\r\n", &mut events);
        assert!(f.is_stopped());
    }
}
