//! A client stream that gives back the bytes already read from it (held
//! while its first unit was judged) before reading the socket again.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `held`, then `inner`; writes go straight to `inner`.
pub(crate) struct Replay<C> {
    held: Vec<u8>,
    pos: usize,
    inner: C,
}

impl<C> Replay<C> {
    pub(crate) fn new(held: Vec<u8>, inner: C) -> Self {
        Replay {
            held,
            pos: 0,
            inner,
        }
    }

    /// The bytes not replayed yet, and the stream.
    pub(crate) fn into_parts(self) -> (Vec<u8>, C) {
        let mut held = self.held;
        held.drain(..self.pos);
        (held, self.inner)
    }
}

impl<C: AsyncRead + Unpin> AsyncRead for Replay<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(rest) = this.held.get(this.pos..).filter(|r| !r.is_empty()) {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            if this.pos == this.held.len() {
                // Replayed: the buffer is not kept for the connection's life.
                this.held = Vec::new();
                this.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for Replay<C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn held_bytes_come_first_then_the_stream() {
        let (a, mut b) = tokio::io::duplex(64);
        b.write_all(b" world").await.unwrap();
        drop(b);
        let mut r = Replay::new(b"hello".to_vec(), a);
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
    }
}
