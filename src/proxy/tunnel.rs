//! Tunnel plumbing: detect what a client sends first (a TLS ClientHello, an
//! HTTP/1.x request head, or anything else) without forwarding it, then copy bytes both ways with an
//! idle timeout, half-close, and a hard stop for the end of the drain.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::BufMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::splice::{self, AsTcp, Spliced, Stream};
use crate::limits::Watch;
use crate::proto::client_hello::{self, ClientHello, MAX_HELLO_LEN};
use crate::proto::{http_head, Parse};

/// Largest number of bytes read while detecting: a maximal hello plus the
/// record headers of a hello split into many records.
pub(crate) const MAX_DETECT_BYTES: usize = MAX_HELLO_LEN + 4 * 1024;

/// What the client sent first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Detected {
    /// A complete TLS ClientHello.
    Tls(ClientHello),
    /// A complete HTTP/1.x request head, with its Host (as sent) if any.
    Http(Option<String>),
    /// Bytes that are neither TLS nor HTTP.
    NotTls,
    /// Nothing within the detect timeout (server-speaks-first protocols).
    Silent,
    /// The client closed before sending anything.
    Closed,
    /// TLS or HTTP that is malformed, incomplete at the timeout or at EOF, or too large.
    Malformed(&'static str),
}

/// Read from `client` into `buf` until the first bytes are classified or
/// `timeout` passes. Nothing is consumed from `buf`: the caller replays it.
pub(crate) async fn detect<R: Stream>(
    client: &mut R,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> Detected {
    let deadline = Instant::now() + timeout;
    // A client that sends nothing yet costs no buffer: wait for its bytes.
    if buf.is_empty() && !readable(client.tcp(), deadline).await {
        return Detected::Silent;
    }
    loop {
        if !buf.is_empty() {
            if let Some(detected) = classify(buf) {
                return detected;
            }
        }
        if buf.len() >= MAX_DETECT_BYTES {
            return Detected::Malformed("client hello too large");
        }
        // Read straight into `buf`'s spare capacity: no zeroed 4 KiB chunk
        // kept in every tunnel task's state.
        let room = (MAX_DETECT_BYTES - buf.len()).min(4096);
        buf.reserve(room);
        let read =
            tokio::time::timeout_at(deadline, client.read_buf(&mut (&mut *buf).limit(room))).await;
        match read {
            Ok(Ok(0)) | Ok(Err(_)) if buf.is_empty() => return Detected::Closed,
            Ok(Ok(0)) | Ok(Err(_)) => return Detected::Malformed("client closed mid hello"),
            Ok(Ok(_)) => {}
            Err(_) if buf.is_empty() => return Detected::Silent,
            Err(_) => return Detected::Malformed("incomplete client hello at detect timeout"),
        }
    }
}

/// What `buf` is, or `None` if more bytes are needed to tell.
fn classify(buf: &[u8]) -> Option<Detected> {
    match client_hello::parse(buf) {
        Parse::Done { value: hello, .. } => Some(Detected::Tls(hello)),
        Parse::Malformed(why) => Some(Detected::Malformed(why)),
        Parse::NeedMore => None,
        Parse::NotThis => match http_head::parse(buf) {
            Parse::Done { value: host, .. } => Some(Detected::Http(host)),
            Parse::NotThis => Some(Detected::NotTls),
            Parse::Malformed(why) => Some(Detected::Malformed(why)),
            Parse::NeedMore => None,
        },
    }
}

/// Bytes moved by a tunnel.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Client to upstream.
    pub up: u64,
    /// Upstream to client.
    pub down: u64,
}

/// Largest size of each direction's copy buffer.
const COPY_BUF: usize = 64 * 1024;
/// A direction's first read after idling takes a buffer of this size,
/// grown to `COPY_BUF` once a read fills it. A read that does not fill it
/// drained the socket: the buffer is given back. An idle direction over
/// TCP holds no buffer (it waits for readability first).
const COPY_BUF_INITIAL: usize = 8 * 1024;

/// Wait until a client's socket `tcp` has bytes (or EOF) to read, at most
/// until `deadline`; `false` at the deadline. Streams that are not TCP
/// sockets (`None`) cannot be waited on without a buffer: `true` at once.
pub(crate) async fn readable(tcp: Option<&TcpStream>, deadline: Instant) -> bool {
    match tcp {
        Some(tcp) => tokio::time::timeout_at(deadline, tcp.readable())
            .await
            .is_ok(),
        None => true,
    }
}

/// Copy both ways until both sides finish, both are silent for `idle`, or
/// `stop` fires. `first_up` is written to the upstream before anything else
/// (the bytes read during detection).
pub(crate) async fn pump<C, U>(
    mut client: C,
    mut upstream: U,
    first_up: &[u8],
    idle: Duration,
    (stop, watch): (&CancellationToken, Option<&Watch>),
) -> Totals
where
    C: Stream,
    U: Stream,
{
    let start = Instant::now();
    let last = AtomicU64::new(0);
    let up = AtomicU64::new(0);
    let down = AtomicU64::new(0);
    let (mut client_r, mut client_w) = client.halves();
    let (mut upstream_r, mut upstream_w) = upstream.halves();
    let ends = Ends::default();

    let touch = || {
        last.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        watch.is_none_or(|w| w.moved(&up, &down))
    };

    let up_dir = async {
        if !first_up.is_empty() {
            if upstream_w.write_all(first_up).await.is_err() {
                return;
            }
            up.fetch_add(first_up.len() as u64, Ordering::Relaxed);
            if !touch() {
                return;
            }
        }
        forward(&mut client_r, &mut upstream_w, &up, &touch, Some(&ends)).await;
    };
    let down_dir = forward(&mut upstream_r, &mut client_w, &down, &touch, Some(&ends));
    // Pinned here and polled through references: every tunnel task holds
    // one copy of each direction's state, not one per combinator.
    tokio::pin!(up_dir, down_dir);
    let both = async {
        tokio::join!(&mut up_dir, &mut down_dir);
    };
    tokio::pin!(both);
    tokio::select! {
        _ = &mut both => {}
        _ = idle_for(idle, start, &last) => {}
        _ = stop.cancelled() => {}
    }
    Totals {
        up: up.load(Ordering::Relaxed),
        down: down.load(Ordering::Relaxed),
    }
}

/// Resolves once `idle` has passed since the later of `start` and the
/// activity mark `last` (milliseconds after `start`), which both copy
/// directions move on every transfer.
pub(crate) async fn idle_for(idle: Duration, start: Instant, last: &AtomicU64) {
    loop {
        let quiet_since = start + Duration::from_millis(last.load(Ordering::Relaxed));
        let due = quiet_since + idle;
        if Instant::now() >= due {
            return;
        }
        tokio::time::sleep_until(due).await;
    }
}

/// Which directions of a tunnel are over. The first to end half-closes
/// its writer (its peer reads EOF while the other direction goes on); the
/// last leaves a TCP writer to the close of both sockets that follows at
/// once, which sends the same FIN: one `shutdown(2)` less per tunnel.
#[derive(Default)]
pub(crate) struct Ends(AtomicBool);

impl Ends {
    /// One direction is over: half-close `writer`, unless the other one is
    /// over too and `writer` is a TCP socket. A writer that is not (TLS)
    /// is always shut down: that sends its close_notify.
    pub(crate) async fn finish<W: AsyncWrite + AsTcp + Unpin>(&self, writer: &mut W) {
        let other_over = self.0.swap(true, Ordering::AcqRel);
        if !(other_over && writer.as_tcp().is_some()) {
            let _ = writer.shutdown().await;
        }
    }
}

/// Move one direction until EOF, an error or `touch` answering `false`
/// (after each transfer): with splice(2) when both ends are TCP sockets,
/// else (or where splice is unavailable) through a user-space buffer.
/// Then, given the tunnel's `ends`, half-close the writer
/// ([`Ends::finish`]); without, the caller does. (Finishing in here, not
/// in an async block around this, keeps each tunnel task's state the
/// size of one direction's future.)
pub(crate) async fn forward<R, W, F>(
    reader: &mut R,
    writer: &mut W,
    count: &AtomicU64,
    touch: &F,
    ends: Option<&Ends>,
) where
    R: AsyncRead + AsTcp + Unpin,
    W: AsyncWrite + AsTcp + Unpin,
    F: Fn() -> bool,
{
    let spliced = match (reader.as_tcp(), writer.as_tcp()) {
        (Some(from), Some(to)) => splice::splice(from, to, None, count, touch).await,
        _ => Spliced::Unsupported,
    };
    if spliced == Spliced::Unsupported {
        copy(reader, writer, count, touch).await;
    }
    if let Some(ends) = ends {
        ends.finish(writer).await;
    }
}

/// Copy one direction until EOF, an error or `touch` answering `false`;
/// the caller half-closes the writer.
pub(crate) async fn copy<R, W, F>(reader: &mut R, writer: &mut W, count: &AtomicU64, touch: &F)
where
    R: AsyncRead + AsTcp + Unpin,
    W: AsyncWrite + Unpin,
    F: Fn() -> bool,
{
    // Reads go into spare (uninitialised) capacity: no memset.
    let mut buf: Vec<u8> = Vec::new();
    let mut size = COPY_BUF_INITIAL;
    loop {
        if buf.capacity() == 0 {
            if let Some(tcp) = reader.as_tcp() {
                if tcp.readable().await.is_err() {
                    break;
                }
            }
            buf.reserve_exact(size);
        }
        buf.clear();
        let n = match reader.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Flushed too: a TLS writer (an upgraded intercepted connection)
        // may keep the tail of a write buffered until the next one, which
        // could be never (a WebSocket message waiting for its echo). A TCP
        // socket's flush returns at once.
        if writer.write_all(&buf[..n]).await.is_err() || writer.flush().await.is_err() {
            break;
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        if !touch() {
            break;
        }
        if n < buf.capacity() {
            // Drained: give the buffer back while the reader is quiet.
            if reader.as_tcp().is_some() {
                buf = Vec::new();
            }
        } else if size < COPY_BUF {
            size = COPY_BUF;
            buf = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    /// A writer that, like a TLS stream over a full socket, holds what it
    /// was given until it is flushed.
    #[derive(Default)]
    struct HeldUntilFlush {
        held: Vec<u8>,
        sent: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl AsyncWrite for HeldUntilFlush {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.held.extend_from_slice(buf);
            std::task::Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let held = std::mem::take(&mut self.held);
            self.sent.lock().unwrap().extend_from_slice(&held);
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.poll_flush(cx)
        }
    }

    /// What a copy wrote reaches the peer while the reader is still open:
    /// a WebSocket message waiting for its echo is never left in a buffer.
    #[tokio::test]
    async fn a_copy_flushes_what_it_wrote_before_waiting_to_read() {
        let (a, mut b) = duplex(1024);
        let (mut reader, _keep) = tokio::io::split(a);
        let mut writer = HeldUntilFlush::default();
        let sent = writer.sent.clone();
        let count = AtomicU64::new(0);
        let copying = copy(&mut reader, &mut writer, &count, &|| true);
        tokio::pin!(copying);
        b.write_all(b"message").await.unwrap();
        let delivered = async {
            while sent.lock().unwrap().as_slice() != b"message" {
                tokio::task::yield_now().await;
            }
        };
        tokio::select! {
            _ = &mut copying => panic!("the copy ended with its reader open"),
            _ = tokio::time::timeout(Duration::from_secs(5), delivered) => {}
        }
        assert_eq!(sent.lock().unwrap().as_slice(), b"message");
    }

    #[tokio::test]
    async fn detect_plain_silent_and_closed() {
        let (mut a, mut b) = duplex(1024);
        b.write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        assert_eq!(
            detect(&mut a, &mut buf, Duration::from_secs(1)).await,
            Detected::Http(Some("a.test".into()))
        );
        assert_eq!(buf, b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n");

        let (mut a, mut b) = duplex(1024);
        b.write_all(b"SSH-2.0-x\r\n").await.unwrap();
        let mut buf = Vec::new();
        assert_eq!(
            detect(&mut a, &mut buf, Duration::from_secs(1)).await,
            Detected::NotTls
        );

        let (mut a, _b) = duplex(1024);
        let mut buf = Vec::new();
        assert_eq!(
            detect(&mut a, &mut buf, Duration::from_millis(50)).await,
            Detected::Silent
        );

        let (mut a, b) = duplex(1024);
        drop(b);
        let mut buf = Vec::new();
        assert_eq!(
            detect(&mut a, &mut buf, Duration::from_secs(1)).await,
            Detected::Closed
        );
    }

    #[tokio::test]
    async fn detect_partial_tls_times_out_as_malformed() {
        let (mut a, mut b) = duplex(1024);
        b.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
            .await
            .unwrap();
        let mut buf = Vec::new();
        let d = detect(&mut a, &mut buf, Duration::from_millis(50)).await;
        assert!(matches!(d, Detected::Malformed(_)), "{d:?}");
    }

    #[tokio::test]
    async fn pump_copies_both_ways_and_counts() {
        let (client, mut client_peer) = duplex(64);
        let (upstream, mut upstream_peer) = duplex(64);
        let stop = CancellationToken::new();
        let task = tokio::spawn(async move {
            pump(
                client,
                upstream,
                b"hello",
                Duration::from_secs(5),
                (&stop, None),
            )
            .await
        });
        let mut got = [0u8; 5];
        upstream_peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        client_peer.write_all(b" world").await.unwrap();
        let mut got = [0u8; 6];
        upstream_peer.read_exact(&mut got).await.unwrap();
        upstream_peer.write_all(b"reply").await.unwrap();
        let mut got = [0u8; 5];
        client_peer.read_exact(&mut got).await.unwrap();
        drop(client_peer);
        drop(upstream_peer);
        let totals = task.await.unwrap();
        assert_eq!(totals, Totals { up: 11, down: 5 });
    }

    #[tokio::test]
    async fn pump_copies_bodies_larger_than_its_buffers_intact() {
        let (client, mut client_peer) = duplex(16 * 1024);
        let (upstream, mut upstream_peer) = duplex(16 * 1024);
        let stop = CancellationToken::new();
        let task = tokio::spawn(async move {
            pump(client, upstream, b"", Duration::from_secs(5), (&stop, None)).await
        });
        let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let sent = body.clone();
        let writer = tokio::spawn(async move {
            upstream_peer.write_all(&sent).await.unwrap();
            upstream_peer.shutdown().await.unwrap();
            upstream_peer
        });
        let mut got = Vec::new();
        client_peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, body);
        drop(client_peer);
        drop(writer.await.unwrap());
        let totals = task.await.unwrap();
        assert_eq!(totals.down, body.len() as u64);
    }

    /// Between TCP sockets (spliced where the kernel allows): intact both
    /// ways, counted, and a client that shuts its write side still
    /// receives everything.
    #[tokio::test]
    async fn pump_over_tcp_half_closes_and_counts() {
        let (client, mut client_peer) = crate::testing::tcp_pair().await;
        let (upstream, mut upstream_peer) = crate::testing::tcp_pair().await;
        let stop = CancellationToken::new();
        let task = tokio::spawn(async move {
            pump(
                client,
                upstream,
                b"hi",
                Duration::from_secs(5),
                (&stop, None),
            )
            .await
        });
        let up: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..2_000_000u32).map(|i| (i % 239) as u8).collect();
        let sent = up.clone();
        let client_side = tokio::spawn(async move {
            client_peer.write_all(&sent).await.unwrap();
            client_peer.shutdown().await.unwrap();
            let mut got = Vec::new();
            client_peer.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut got = Vec::new();
        upstream_peer.read_to_end(&mut got).await.unwrap();
        assert!(
            got == [&b"hi"[..], &up].concat(),
            "upstream got other bytes"
        );
        upstream_peer.write_all(&down).await.unwrap();
        upstream_peer.shutdown().await.unwrap();
        let got = client_side.await.unwrap();
        assert!(got == down, "client got other bytes");
        let totals = task.await.unwrap();
        assert_eq!(
            totals,
            Totals {
                up: up.len() as u64 + 2,
                down: down.len() as u64
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn pump_stops_when_idle() {
        let (client, _client_peer) = duplex(64);
        let (upstream, _upstream_peer) = duplex(64);
        let stop = CancellationToken::new();
        let totals = pump(
            client,
            upstream,
            b"",
            Duration::from_secs(30),
            (&stop, None),
        )
        .await;
        assert_eq!(totals, Totals::default());
    }
}
