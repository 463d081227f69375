//! `TCP_NODELAY` on both legs of every proxy mode. Without it, a client
//! that writes a request in two pieces waits for the proxy's second segment
//! until the first is acknowledged, and a delayed ACK makes that ~40 ms per
//! exchange. A socket's option is not visible from the far end, so the test
//! holds one connection open through each mode (explicit CONNECT,
//! absolute-form forwarding with its pooled upstream, SOCKS5, transparent)
//! and reads the option on every connected TCP socket of the proxy
//! process (`pidfd_getfd(2)` gives the test a duplicate of each).

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{FromRawFd, RawFd};
use std::time::Duration;

use crate::lab::{self, Lab, BANNER, BANNER_PORT};
use crate::transparent::{load_gateway, TRANSPARENT};

const SOCKS_ADDR: &str = "198.18.1.1:1080";
const WAIT: Duration = Duration::from_secs(5);

#[test]
fn every_proxied_connection_has_nodelay_on_both_legs() {
    let lab = Lab::builder()
        .policy(&lab::banner_policy())
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .proxy_option(&format!("transparent = [{TRANSPARENT:?}]"))
        .start();

    // Explicit CONNECT: an opaque tunnel to the banner service.
    let mut tunnel = lab.client_conn();
    assert_eq!(tunnel.connect(&format!("allowed.test:{BANNER_PORT}")), 200);
    assert!(
        tunnel.read_until(BANNER.as_bytes(), WAIT).is_some(),
        "banner through CONNECT"
    );

    // Absolute-form forwarding, kept alive (its upstream stays pooled).
    let mut forward = lab.client_conn();
    forward
        .send(b"GET http://allowed.test/nodelay HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        .unwrap();
    assert_eq!(forward.read_response(WAIT).status, 200, "forwarded GET");

    // SOCKS5 CONNECT by name to the banner service.
    let mut socks = lab.client_conn_to(SOCKS_ADDR);
    socks.send(&[5, 1, 0]).unwrap();
    assert!(socks.read_until(&[5, 0], WAIT).is_some(), "SOCKS5 method");
    let name = b"allowed.test";
    let mut req = vec![5, 1, 0, 3, name.len() as u8];
    req.extend_from_slice(name);
    req.extend_from_slice(&BANNER_PORT.to_be_bytes());
    socks.send(&req).unwrap();
    assert!(
        socks.read_until(BANNER.as_bytes(), WAIT).is_some(),
        "banner through SOCKS5"
    );

    // Transparent: plain HTTP through the gateway, kept alive (the
    // connections above are established, so the gateway lets them be).
    load_gateway(&lab);
    let mut transparent = lab.client_conn_to(&format!("{}:80", lab::ALLOWED_IP));
    transparent
        .send(b"GET /nodelay HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        .unwrap();
    assert_eq!(
        transparent.read_response(WAIT).status,
        200,
        "transparent GET"
    );

    let sockets = connected_tcp_sockets(lab.proxy_pid());
    let without: Vec<_> = sockets.iter().filter(|s| !s.nodelay).collect();
    assert!(
        without.is_empty(),
        "sockets without TCP_NODELAY: {without:?}\nall: {sockets:?}"
    );
    // The four client legs (two explicit), and upstream legs: both
    // tunnels' and the transparent one's at least (the forwarded GET's
    // upstream may have closed after its response).
    let on = |port: u16| sockets.iter().filter(|s| s.local.port() == port).count();
    assert_eq!(
        [on(3128), on(1080), on(15001)],
        [2, 1, 1],
        "client legs: {sockets:?}"
    );
    assert!(sockets.len() >= 7, "connected TCP sockets: {sockets:?}");
    for conn in [tunnel, forward, socks, transparent] {
        conn.close();
    }
}

#[derive(Debug)]
#[allow(dead_code)] // read through Debug in failure messages
struct Socket {
    fd: RawFd,
    local: SocketAddr,
    peer: SocketAddr,
    nodelay: bool,
}

/// Every connected TCP socket of process `pid` but the admin API's.
fn connected_tcp_sockets(pid: u32) -> Vec<Socket> {
    // SAFETY: plain system calls on integers; the descriptors they return
    // are owned below (closed by the TcpStream or explicitly).
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) } as RawFd;
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    let mut found = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: as above.
        let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as RawFd;
        if dup < 0 {
            continue; // closed meanwhile
        }
        let mut kind: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `kind` and `len` are valid for the call.
        let ok = unsafe {
            libc::getsockopt(
                dup,
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&mut kind as *mut libc::c_int).cast(),
                &mut len,
            )
        } == 0;
        if !ok || kind != libc::SOCK_STREAM {
            // SAFETY: `dup` is ours.
            unsafe { libc::close(dup) };
            continue;
        }
        // SAFETY: `dup` is an open stream socket we own; the TcpStream
        // closes it.
        let stream = unsafe { TcpStream::from_raw_fd(dup) };
        let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else {
            continue; // a listener, or not an IP socket
        };
        if local.port() == 9711 {
            continue; // the admin API
        }
        found.push(Socket {
            fd,
            local,
            peer,
            nodelay: stream.nodelay().unwrap_or(false),
        });
    }
    // SAFETY: ours.
    unsafe { libc::close(pidfd) };
    found
}
