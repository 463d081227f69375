//! A receive buffer as large as asked: for sockets a flood fills while
//! their reader is not running (the DNS shim's UDP sockets, the NFLOG
//! socket), where what does not fit is dropped by the kernel.

use std::io;
use std::os::fd::AsFd;

use rustix::net::sockopt;

/// Ask for a receive buffer of `bytes`: forced (`SO_RCVBUFFORCE`) where
/// the process may (`CAP_NET_ADMIN` in the socket's namespace), else as
/// much of it as `net.core.rmem_max` allows (`SO_RCVBUF`). Returns the
/// size granted, in the units asked (the kernel reports twice the size,
/// its bookkeeping included).
pub(crate) fn grow_receive_buffer(sock: &impl AsFd, bytes: usize) -> io::Result<usize> {
    if sockopt::set_socket_recv_buffer_size_force(sock, bytes).is_err() {
        sockopt::set_socket_recv_buffer_size(sock, bytes)?;
    }
    Ok(sockopt::get_socket_recv_buffer_size(sock)? / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receive_buffer_is_granted_as_asked_or_as_rmem_max_allows() {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let asked = 4 << 20;
        let got = grow_receive_buffer(&sock, asked).unwrap();
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Root (the tests, CI) may force it; anyone else gets rmem_max.
        assert!(got == asked || got == rmem_max.min(asked), "{got}");
        let default = 212_992;
        assert!(got > default, "{got}: no larger than the kernel's default");
    }
}
