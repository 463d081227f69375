//! Zero-copy relaying: once a tunnel direction only copies (an opaque
//! tunnel, TLS after the ServerHello, the body of known length of an HTTP
//! message), its bytes move socket -> pipe -> socket with splice(2) and never
//! enter user space.
//!
//! - [`Stream`]: what a tunnel end is. A `TcpStream` splits into halves that
//!   show the socket under them ([`AsTcp`]); any other stream (a test
//!   duplex, an HTTP upgrade hyper would not hand back) splits through
//!   tokio and is copied in user space.
//! - [`splice`]: one direction, until EOF, an error, or a byte limit. It
//!   answers [`Spliced::Unsupported`] when splice(2) fails before any byte
//!   moved (non-Linux, a kernel or socket without it, or `PALISADE_SPLICE=off`),
//!   and the caller copies in user space instead, from the same point.
//! - Pipes are taken when a socket is readable and given back, empty, to a
//!   small pool ([`MAX_POOLED`]) as soon as a direction drains: an idle
//!   tunnel holds no pipe and no buffer, so 1000 idle tunnels cost no
//!   extra file descriptors.
//!
//! Readiness: the socket is read into the pipe only while the pipe is
//! empty, so an `EAGAIN` always means the socket has nothing (a full pipe
//! must not clear the socket's read readiness, or the direction would wait
//! for an edge that never comes).

use std::io;
use std::sync::atomic::AtomicU64;

use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio::net::{tcp, TcpStream};

/// The TCP socket under a stream half, when there is one.
pub(crate) trait AsTcp {
    fn as_tcp(&self) -> Option<&TcpStream>;
}

impl AsTcp for tcp::ReadHalf<'_> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        Some(self.as_ref())
    }
}

impl AsTcp for tcp::WriteHalf<'_> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        Some(self.as_ref())
    }
}

impl<T> AsTcp for tokio::io::ReadHalf<T> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        None
    }
}

impl<T> AsTcp for tokio::io::WriteHalf<T> {
    fn as_tcp(&self) -> Option<&TcpStream> {
        None
    }
}

/// One end of a tunnel: split into a read and a write half that may show
/// the TCP socket under them.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {
    type Read<'a>: AsyncRead + AsTcp + Unpin + Send
    where
        Self: 'a;
    type Write<'a>: AsyncWrite + AsTcp + Unpin + Send
    where
        Self: 'a;

    fn halves(&mut self) -> (Self::Read<'_>, Self::Write<'_>);

    /// The TCP socket, to wait for readability before taking a buffer.
    fn tcp(&self) -> Option<&TcpStream>;
}

impl Stream for TcpStream {
    type Read<'a> = tcp::ReadHalf<'a>;
    type Write<'a> = tcp::WriteHalf<'a>;

    fn halves(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        self.split()
    }

    fn tcp(&self) -> Option<&TcpStream> {
        Some(self)
    }
}

/// Streams copied in user space only.
macro_rules! user_space {
    ($($t:ty),* $(,)?) => {$(
        impl Stream for $t {
            type Read<'a> = tokio::io::ReadHalf<&'a mut $t>;
            type Write<'a> = tokio::io::WriteHalf<&'a mut $t>;

            fn halves(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
                tokio::io::split(self)
            }

            fn tcp(&self) -> Option<&TcpStream> {
                None
            }
        }
    )*};
}

user_space!(DuplexStream, TokioIo<Upgraded>);

/// How a spliced direction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spliced {
    /// splice(2) is not available here; no byte was read or written.
    Unsupported,
    /// The reader reached EOF; everything read was written.
    Eof,
    /// The byte limit was reached and written.
    Limit,
    /// A read or write failed (bytes read and not written are lost, as in
    /// a user-space copy whose write fails).
    Failed,
}

/// Idle pipes kept for reuse (each is two file descriptors).
pub(crate) const MAX_POOLED: usize = 64;

/// Is splicing switched on? `PALISADE_SPLICE=off` in the environment
/// forces the user-space copy (a diagnostic switch; the tests use it).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("PALISADE_SPLICE").is_none_or(|v| v != "off"))
}

/// Move bytes from `from` to `to` with splice(2) until EOF, an error, or
/// `limit` bytes (when given). Written bytes are added to `count` and
/// `touch` is called after each write, as the user-space copy does, and
/// ends the move (as `Failed`) when it answers `false`. The
/// writer is not shut down: the caller does that, whatever the end.
pub(crate) async fn splice<F: Fn() -> bool>(
    from: &TcpStream,
    to: &TcpStream,
    limit: Option<u64>,
    count: &AtomicU64,
    touch: &F,
) -> Spliced {
    imp::splice(from, to, limit, count, touch).await
}

/// Bytes to ask of one splice into an empty pipe: the size pipes are
/// asked to have (fewer, larger moves). Where the kernel keeps a pipe
/// smaller (an unprivileged user past `pipe-user-pages-soft`), a splice
/// simply moves less: an empty pipe still takes at least one page.
const PIPE_CHUNK: usize = 256 * 1024;

/// How much of `left` (a byte limit, `None` for none) one splice may ask.
pub(crate) fn want(left: Option<u64>) -> usize {
    match left {
        Some(left) => usize::try_from(left).unwrap_or(usize::MAX).min(PIPE_CHUNK),
        None => PIPE_CHUNK,
    }
}

/// Is `e` the kernel saying splice(2) cannot be used here at all?
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::INVAL.raw_os_error()
            || code == rustix::io::Errno::NOSYS.raw_os_error()
            || code == rustix::io::Errno::OPNOTSUPP.raw_os_error()
    )
}

/// Pooled pipes, with accounting for tests and metrics.
pub(crate) struct Pool<P> {
    idle: std::sync::Mutex<Vec<P>>,
    max: usize,
}

impl<P> Pool<P> {
    pub(crate) const fn new(max: usize) -> Self {
        Pool {
            idle: std::sync::Mutex::new(Vec::new()),
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<P>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An idle pipe, if one is pooled.
    pub(crate) fn take(&self) -> Option<P> {
        self.lock().pop()
    }

    /// Keep an empty pipe for reuse; beyond `max` it is dropped (closed).
    pub(crate) fn give(&self, pipe: P) {
        let mut idle = self.lock();
        if idle.len() < self.max {
            idle.push(pipe);
        }
    }

    /// Pipes now pooled.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use rustix::pipe::{pipe_with, PipeFlags, SpliceFlags};
    use tokio::io::Interest;
    use tokio::net::TcpStream;

    use super::{enabled, unsupported, want, Pool, Spliced, MAX_POOLED};

    /// A pipe: (read end, write end), both non-blocking.
    pub(super) struct Pipe(OwnedFd, OwnedFd);

    static POOL: Pool<Pipe> = Pool::new(MAX_POOLED);

    fn pipe() -> io::Result<Pipe> {
        if let Some(p) = POOL.take() {
            return Ok(p);
        }
        let (r, w) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        // Best effort: the default (64 KiB) works too.
        let _ = rustix::pipe::fcntl_setpipe_size(&w, super::PIPE_CHUNK);
        Ok(Pipe(r, w))
    }

    const FLAGS: SpliceFlags = SpliceFlags::NONBLOCK.union(SpliceFlags::MOVE);

    pub(super) async fn splice<F: Fn() -> bool>(
        from: &TcpStream,
        to: &TcpStream,
        limit: Option<u64>,
        count: &AtomicU64,
        touch: &F,
    ) -> Spliced {
        if !enabled() {
            return Spliced::Unsupported;
        }
        let mut left = limit;
        let mut pipe: Option<Pipe> = None;
        // Bytes in the pipe, not yet written.
        let mut in_pipe = 0usize;
        let mut moved = false;
        // Reset when this direction ends, however it ends.
        let mut low = LowWater {
            sock: from,
            mark: 1,
        };
        loop {
            if in_pipe == 0 {
                if left == Some(0) {
                    give_back(pipe);
                    return Spliced::Limit;
                }
                let p = match pipe.take() {
                    Some(p) => p,
                    None => match self::pipe() {
                        Ok(p) => p,
                        Err(_) if !moved => return Spliced::Unsupported,
                        Err(_) => return Spliced::Failed,
                    },
                };
                let ask = want(left);
                // The pipe is empty: EAGAIN can only be the socket's.
                let read = from.try_io(Interest::READABLE, || {
                    rustix::pipe::splice(from, None, &p.1, None, ask, FLAGS)
                        .map_err(io::Error::from)
                });
                match read {
                    Ok(0) => {
                        give_back(Some(p));
                        return Spliced::Eof;
                    }
                    Ok(n) => {
                        in_pipe = n;
                        left = left.map(|l| l.saturating_sub(n as u64));
                        pipe = Some(p);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        // Drained: hold no pipe while waiting.
                        give_back(Some(p));
                        if !wait_readable(from, left, &mut low).await {
                            return Spliced::Failed;
                        }
                        continue;
                    }
                    Err(e) if !moved && unsupported(&e) => {
                        give_back(Some(p));
                        return Spliced::Unsupported;
                    }
                    Err(_) => return Spliced::Failed,
                }
            }
            let Some(p) = pipe.as_ref() else {
                return Spliced::Failed;
            };
            let wrote = to.try_io(Interest::WRITABLE, || {
                rustix::pipe::splice(&p.0, None, to, None, in_pipe, FLAGS).map_err(io::Error::from)
            });
            match wrote {
                Ok(0) => return Spliced::Failed,
                Ok(n) => {
                    moved = true;
                    in_pipe = in_pipe.saturating_sub(n);
                    count.fetch_add(n as u64, Ordering::Relaxed);
                    if !touch() {
                        // Told to stop (a spent volume budget): the pipe
                        // may hold bytes, so it is closed, not pooled.
                        return Spliced::Failed;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if to.writable().await.is_err() {
                        return Spliced::Failed;
                    }
                }
                // Bytes sitting in the pipe cannot go back to the socket:
                // any write error is an end, even at the first write.
                Err(_) => return Spliced::Failed,
            }
        }
    }

    /// A body this long or longer waits for [`LOW_WATER`] bytes (or what
    /// is left of it, if less) per wake-up instead of each segment.
    const LOW_WATER_FROM: u64 = 128 * 1024;
    const LOW_WATER: u64 = 256 * 1024;
    /// How long a wait for the low-water mark may take before it gives up
    /// and takes what is there: a body that trickles is not held back
    /// (its bytes wait at most this long), a fast one wakes per
    /// [`LOW_WATER`] bytes.
    const LOW_WATER_WAIT: Duration = Duration::from_millis(1);

    /// The socket's `SO_RCVLOWAT` as this direction set it; back to 1 (the
    /// default, and what the verifier reading the next head needs) when
    /// dropped.
    struct LowWater<'a> {
        sock: &'a TcpStream,
        mark: u64,
    }

    impl LowWater<'_> {
        fn set(&mut self, mark: u64) {
            if mark != self.mark && set_rcvlowat(self.sock, mark).is_ok() {
                self.mark = mark;
            }
        }
    }

    impl Drop for LowWater<'_> {
        fn drop(&mut self) {
            self.set(1);
        }
    }

    /// Wait until `from` is readable: while much of a body is `left`, until
    /// [`LOW_WATER`] bytes are there, at most [`LOW_WATER_WAIT`]; false if
    /// the socket failed.
    async fn wait_readable(from: &TcpStream, left: Option<u64>, low: &mut LowWater<'_>) -> bool {
        match left {
            Some(left) if left >= LOW_WATER_FROM => {
                low.set(left.min(LOW_WATER));
                match tokio::time::timeout(LOW_WATER_WAIT, from.readable()).await {
                    Ok(ready) => return ready.is_ok(),
                    // Setting the mark lower wakes a reader if what is
                    // there reaches it now.
                    Err(_) => low.set(1),
                }
            }
            _ => low.set(1),
        }
        from.readable().await.is_ok()
    }

    /// `setsockopt(SO_RCVLOWAT)`: readiness (and the kernel's wake-up of
    /// the reader) only once `mark` bytes are queued, or at EOF.
    #[allow(unsafe_code)]
    fn set_rcvlowat(sock: &TcpStream, mark: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let value = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
        // SAFETY: the fd is a socket `sock` owns and keeps open for the
        // whole call (borrowed); the option value points at a live c_int on
        // this stack frame and the length passed is exactly its size, so
        // the kernel reads only initialised memory we own; setsockopt
        // writes nothing back. No Rust invariant depends on the socket's
        // low-water mark.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                std::ptr::from_ref(&value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// An empty pipe goes back to the pool.
    fn give_back(pipe: Option<Pipe>) {
        if let Some(p) = pipe {
            POOL.give(p);
        }
    }

    /// Pipes now pooled (tests).
    #[cfg(test)]
    pub(super) fn pooled() -> usize {
        POOL.idle()
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::sync::atomic::AtomicU64;
    use tokio::net::TcpStream;

    use super::Spliced;

    pub(super) async fn splice<F: Fn() -> bool>(
        _from: &TcpStream,
        _to: &TcpStream,
        _limit: Option<u64>,
        _count: &AtomicU64,
        _touch: &F,
    ) -> Spliced {
        Spliced::Unsupported
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bound of [`tunnel_task_state_is_small`] (a debug build; 10.7 KB
    /// before the intercept path, the opaque path and the record writes
    /// were boxed and the pumps' directions pinned in place).
    /// (+64: a tunnel's volume budget lease, its watch and the client's
    /// Retry-After, 24 bytes, on top of a state already at 4 KiB.)
    /// (+32: which directions are over, so the last leaves its FIN to the
    /// close (one `shutdown(2)` less per tunnel), and whether a grant's
    /// requests are decided inside: 4,176 bytes.)
    const TASK_STATE_MAX: usize = 4 * 1024 + 96;

    #[test]
    fn want_is_bounded_by_the_limit_and_the_pipe() {
        assert_eq!(want(None), PIPE_CHUNK);
        assert_eq!(want(Some(10)), 10);
        assert_eq!(want(Some(0)), 0);
        assert_eq!(want(Some(u64::MAX)), PIPE_CHUNK);
    }

    #[test]
    fn the_pool_keeps_at_most_max() {
        let pool = Pool::new(2);
        assert!(pool.take().is_none());
        pool.give(1);
        pool.give(2);
        pool.give(3);
        assert_eq!(pool.idle(), 2);
        assert!(pool.take().is_some());
        assert_eq!(pool.idle(), 1);
    }

    /// What every tunnel task holds for its whole life, idle or not: the
    /// state of [`crate::proxy::connect::run`]. Bounded here so that it
    /// cannot grow back unnoticed (`--nocapture` prints it).
    #[test]
    fn tunnel_task_state_is_small() {
        fn size<A, B, C, D, F>(_: impl Fn(A, B, C, D) -> F) -> usize {
            std::mem::size_of::<F>()
        }
        let tcp = size(crate::proxy::connect::run::<TcpStream>);
        let upgraded = size(crate::proxy::connect::run::<TokioIo<Upgraded>>);
        eprintln!("connect::run future: {tcp} bytes over TCP, {upgraded} over an upgrade");
        assert!(tcp <= TASK_STATE_MAX, "{tcp} bytes");
    }

    /// Bytes through splice arrive intact and counted; at EOF the pipe is
    /// back in the pool; a limit stops exactly there.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn splices_intact_counts_and_stops_at_a_limit() {
        let (mut src, from) = crate::testing::tcp_pair().await;
        let (to, mut dst) = crate::testing::tcp_pair().await;
        let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let sent = body.clone();
        let writer = tokio::spawn(async move {
            src.write_all(&sent).await.unwrap();
            src.write_all(b"tail").await.unwrap();
            src
        });
        let count = AtomicU64::new(0);
        let touched = AtomicU64::new(0);
        let touch = || touched.fetch_add(1, Ordering::Relaxed) < u64::MAX;
        let limit = body.len() as u64;
        let reader = async {
            let mut got = vec![0u8; body.len()];
            dst.read_exact(&mut got).await.unwrap();
            got
        };
        let (end, got) = tokio::join!(splice(&from, &to, Some(limit), &count, &touch), reader);
        assert_eq!(end, Spliced::Limit);
        assert_eq!(count.load(Ordering::Relaxed), limit);
        assert!(touched.load(Ordering::Relaxed) > 0);
        assert!(got == body, "bytes differ");
        // The tail is still in the socket, unread.
        let mut src = writer.await.unwrap();
        src.shutdown().await.unwrap();
        let end = splice(&from, &to, None, &count, &touch).await;
        assert_eq!(end, Spliced::Eof);
        assert_eq!(count.load(Ordering::Relaxed), limit + 4);
        let mut tail = [0u8; 4];
        dst.read_exact(&mut tail).await.unwrap();
        assert_eq!(&tail, b"tail");
        assert!(imp::pooled() >= 1, "the drained pipe was pooled");
    }

    /// A long body that arrives in pieces is not held back for the
    /// low-water mark: each piece reaches the reader before the sender
    /// sends the next (a mark kept for ever would hang here); and after the
    /// body the mark is back at 1, so a 4-byte tail wakes a reader.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_long_body_is_never_held_for_the_low_water_mark_which_goes_back_after() {
        let (mut src, from) = crate::testing::tcp_pair().await;
        let (to, mut dst) = crate::testing::tcp_pair().await;
        let piece = vec![7u8; 20_000];
        let limit = 1_000_000u64;
        let count = AtomicU64::new(0);
        let touch = || true;
        let pieces = async {
            for _ in 0..(limit / piece.len() as u64) {
                src.write_all(&piece).await.unwrap();
                let mut got = vec![0u8; piece.len()];
                let read = tokio::time::timeout(Duration::from_secs(10), dst.read_exact(&mut got));
                assert!(read.await.is_ok(), "a piece was held back");
                assert_eq!(got, piece);
            }
        };
        let (end, ()) = tokio::join!(splice(&from, &to, Some(limit), &count, &touch), pieces);
        assert_eq!(end, Spliced::Limit);
        // A body that comes at once ends with the mark up (it was met):
        // dropping the direction puts it back.
        let body = vec![9u8; 1_000_000];
        let burst = async {
            src.write_all(&body).await.unwrap();
        };
        let drain = async {
            let mut got = vec![0u8; body.len()];
            dst.read_exact(&mut got).await.unwrap();
        };
        let (end, (), ()) = tokio::join!(
            splice(&from, &to, Some(limit), &count, &touch),
            burst,
            drain
        );
        assert_eq!(end, Spliced::Limit);
        // Nothing is queued: clear the read readiness, then a short tail
        // must make the socket readable again.
        let mut buf = [0u8; 16];
        assert_eq!(
            from.try_read(&mut buf).unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock
        );
        src.write_all(b"tail").await.unwrap();
        let ready = tokio::time::timeout(Duration::from_secs(10), from.readable()).await;
        assert!(ready.is_ok(), "the low-water mark was left set");
        let n = from.try_read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"tail");
    }
}
