//! Each HTTP/1.1 request's bytes as the client sent them: the head
//! (request line, headers, any empty lines before it) and the body with
//! any chunk framing, split into requests by the pure [`Framer`] as hyper
//! reads the connection. Evidence counts `bytes_up` from here.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::proto::http_meter::{Event, Framer};

/// `bytes_up` of a forwarded request: every byte the client sent for it.
pub(crate) enum UpCount {
    /// As counted on the wire by the connection's [`Meter`].
    Wire(Arc<RequestBytes>),
    /// Should the meter have lost track: the head as hyper parsed it, and
    /// the body as forwarded.
    Estimate { head: u64, body: Arc<AtomicU64> },
}

impl UpCount {
    pub(crate) fn get(&self) -> u64 {
        match self {
            UpCount::Wire(bytes) => bytes.total(),
            UpCount::Estimate { head, body } => head + body.load(Ordering::Relaxed),
        }
    }
}

/// The bytes one request took on the wire: its head (request line, headers,
/// any empty lines before it) and its body with any chunk framing.
#[derive(Debug)]
pub(crate) struct RequestBytes {
    head: u64,
    body: AtomicU64,
}

impl RequestBytes {
    pub(crate) fn total(&self) -> u64 {
        self.head + self.body.load(Ordering::Relaxed)
    }
}

/// Splits what one client connection sends into requests as hyper reads it
/// (see [`Framer`]); the service takes each request's count in turn.
#[derive(Debug)]
pub(crate) struct Meter {
    state: Mutex<MeterState>,
}

#[derive(Debug)]
struct MeterState {
    framer: Framer,
    /// Requests whose heads were read and that the service has not taken yet.
    pending: VecDeque<Arc<RequestBytes>>,
    /// The request whose body the bytes now belong to.
    current: Option<Arc<RequestBytes>>,
    events: Vec<Event>,
}

impl Meter {
    pub(crate) fn new(max_head: usize) -> Meter {
        Meter {
            state: Mutex::new(MeterState {
                framer: Framer::new(max_head),
                pending: VecDeque::new(),
                current: None,
                events: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes just read from the client.
    fn read(&self, data: &[u8]) {
        let mut st = self.lock();
        if st.framer.is_stopped() {
            return;
        }
        let mut events = std::mem::take(&mut st.events);
        st.framer.feed(data, &mut events);
        st.apply(&mut events);
        st.events = events;
    }

    /// The count of the next request hyper hands the service; `None` if
    /// the meter lost track.
    pub(crate) fn next_request(&self) -> Option<Arc<RequestBytes>> {
        self.lock().pending.pop_front()
    }

    /// The CONNECT just handled was answered: a tunnel (`accepted`) takes the
    /// rest of the connection; otherwise the next request follows.
    pub(crate) fn connect_answered(&self, accepted: bool) {
        let mut st = self.lock();
        if accepted {
            st.framer.stop();
            st.pending.clear();
            st.current = None;
        } else {
            let mut events = std::mem::take(&mut st.events);
            st.framer.resume(&mut events);
            st.apply(&mut events);
            st.events = events;
        }
    }
}

impl MeterState {
    fn apply(&mut self, events: &mut Vec<Event>) {
        for event in events.drain(..) {
            match event {
                Event::Head { len } => {
                    let bytes = Arc::new(RequestBytes {
                        head: len,
                        body: AtomicU64::new(0),
                    });
                    self.pending.push_back(bytes.clone());
                    self.current = Some(bytes);
                }
                Event::Body(n) => {
                    if let Some(current) = &self.current {
                        current.body.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

/// The client connection, with every byte read shown to the [`Meter`].
pub(crate) struct MeteredIo<T> {
    inner: T,
    meter: Arc<Meter>,
}

impl<T> MeteredIo<T> {
    pub(crate) fn new(inner: T, meter: Arc<Meter>) -> Self {
        MeteredIo { inner, meter }
    }

    /// The stream, once nothing more is to be counted (a CONNECT tunnel
    /// took the connection).
    pub(crate) fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for MeteredIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            if let Some(new) = buf.filled().get(before..) {
                if !new.is_empty() {
                    self.meter.read(new);
                }
            }
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for MeteredIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http::{Method, Request, Response, StatusCode};
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper::service::service_fn;

    use super::super::{full, serve, Drain, Protocol};
    use super::*;

    /// The meter against hyper itself: pipelined requests of every framing
    /// on one connection, each counted exactly as sent.
    #[tokio::test]
    async fn each_request_counts_the_bytes_it_took_on_the_wire() {
        let long = format!("http://a.test/{}", "x".repeat(3000));
        let requests: Vec<Vec<u8>> = vec![
            format!(
                "GET {long} HTTP/1.1\r\nHost: a.test\r\nX-Pad:   {}  \r\n\r\n",
                "p".repeat(500)
            )
            .into_bytes(),
            b"\r\nPOST http://a.test/ HTTP/1.1\nHost: a.test\ncontent-length: 11\n\nhello world"
                .to_vec(),
            b"PUT http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
              5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
                .to_vec(),
            b"CONNECT b.test:443 HTTP/1.1\r\nHost: b.test:443\r\n\r\n".to_vec(),
            b"GET http://a.test/last HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
                .to_vec(),
        ];
        let (client, server) = tokio::io::duplex(1 << 20);
        let meter = Arc::new(Meter::new(64 * 1024));
        let io = MeteredIo::new(server, meter.clone());
        let svc_meter = meter.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let meter = svc_meter.clone();
            async move {
                let bytes = meter.next_request();
                let connect = req.method() == Method::CONNECT;
                let _ = req.into_body().collect().await;
                let counted = bytes.map_or(0, |b| b.total());
                let mut resp = Response::new(full(counted.to_string()));
                if connect {
                    *resp.status_mut() = StatusCode::FORBIDDEN;
                    meter.connect_answered(false);
                }
                Ok::<_, Infallible>(resp)
            }
        });
        let server = tokio::spawn(async move {
            let never = tokio_util::sync::CancellationToken::new();
            let protocol = Protocol::Http1 {
                header_read_timeout: std::time::Duration::from_secs(5),
                max_buf_size: 64 * 1024,
                max_headers: 100,
            };
            let drain = Drain {
                shutdown: &never,
                hard_stop: &never,
            };
            serve(io, service, protocol, drain).await
        });
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut rd, mut wr) = tokio::io::split(client);
        wr.write_all(&requests.concat()).await.unwrap();
        let mut out = Vec::new();
        rd.read_to_end(&mut out).await.unwrap();
        let _ = server.await;
        let text = String::from_utf8_lossy(&out);
        let counts: Vec<u64> = text
            .split("HTTP/1.1 ")
            .skip(1)
            .map(|resp| {
                let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default();
                body.parse().unwrap_or_else(|_| panic!("{resp}"))
            })
            .collect();
        let want: Vec<u64> = requests.iter().map(|r| r.len() as u64).collect();
        assert_eq!(counts, want, "{text}");
    }
}
