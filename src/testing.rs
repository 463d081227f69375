//! Helpers the unit tests share.

use std::path::PathBuf;

/// A fresh, empty directory under the system temp dir, unique per call
/// (`palisade-TAG-` and a random suffix, made by `tempfile`). It is kept
/// after the test, for a look at what a failing test left.
pub(crate) fn scratch(tag: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("palisade-{tag}-"))
        .tempdir()
        .expect("create scratch dir")
        .into_path()
}

/// Two connected loopback TCP sockets.
pub(crate) async fn tcp_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (a, b) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    (a.unwrap(), b.unwrap().0)
}
