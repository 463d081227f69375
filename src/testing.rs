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

/// ClientHellos captured from real clients (`tests/data/`).
pub(crate) mod hellos {
    /// `openssl s_client`'s.
    pub(crate) const OPENSSL: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/client_hello_openssl.bin"
    ));
    /// curl's.
    pub(crate) const CURL: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/client_hello_curl.bin"
    ));
    /// One larger than a TLS record.
    pub(crate) const LARGE: &[u8] = include_bytes!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/client_hello_large.bin"
    ));
}

/// A decision record: acme's client at 198.18.1.2 denied
/// `no_matching_rule` a TCP connection to port 443 (no host), with the
/// fields of each of `overrides` (JSON objects) set over it in turn.
pub(crate) fn record(overrides: &[&str]) -> crate::evidence::Record {
    let mut v = serde_json::json!({
        "id": "r1", "ts": "2026-01-02T03:04:05.000000Z", "kind": "tcp",
        "event": "decision", "org": "acme", "client": "198.18.1.2:40000",
        "mode": "explicit", "host": null, "port": 443, "sni": null, "ip": null,
        "decision": "deny", "reason": "no_matching_rule", "rule": null, "policy": "p"
    });
    for json in overrides {
        let extra: serde_json::Value = serde_json::from_str(json).unwrap();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
    }
    serde_json::from_value(v).unwrap()
}

/// The `[[org]]` table of `name` with `clients`, and an allow rule (its
/// default ports) for each host of `allow`, as TOML.
pub(crate) fn org_toml(name: &str, clients: &[&str], allow: &[&str]) -> String {
    let mut toml = format!("[[org]]\nname = {name:?}\nclients = {clients:?}\n");
    for host in allow {
        toml += &format!("[[org.allow]]\nhost = {host:?}\n");
    }
    toml
}
