#!/usr/bin/env python3
"""Capture the first bytes a TLS client sends, for the ClientHello parser tests.

Listens on 127.0.0.1:PORT, accepts one connection, reads until 3 s idle or
20 KiB, writes the bytes to OUT and closes without answering (the client
then gives up). Usage: capture_client_hello.py PORT OUT

How the files in this directory were made (OpenSSL 3.0.19, curl 7.88.1):

  client_hello_openssl.bin:
    capture_client_hello.py 47001 client_hello_openssl.bin &
    openssl s_client -connect 127.0.0.1:47001 -servername api.example.com \
        -alpn h2,http/1.1 </dev/null
  client_hello_curl.bin:
    capture_client_hello.py 47002 client_hello_curl.bin &
    curl -sk --max-time 3 https://api.example.com:47002/ \
        --resolve api.example.com:47002:127.0.0.1
  client_hello_large.bin (> 1500 bytes, like a post-quantum hello; OpenSSL
  3.0 has no ML-KEM, so an ffdhe8192 key share (1024 bytes) stands in):
    capture_client_hello.py 47004 client_hello_large.bin &
    openssl s_client -connect 127.0.0.1:47004 -servername large.example.com \
        -groups ffdhe8192:X25519:P-256 -cipher 'ALL:@SECLEVEL=0' \
        -alpn h2,http/1.1,spdy/3.1,h2c,acme-tls/1,http/1.0,stun.turn,webrtc,c-webrtc,ftp,imap,pop3,managesieve,coap,xmpp-client,xmpp-server,sunrpc,dot,ntske/1 \
        </dev/null
"""
import socket
import sys


def main() -> None:
    port, out = int(sys.argv[1]), sys.argv[2]
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    srv.settimeout(30)
    conn, _ = srv.accept()
    conn.settimeout(3)
    data = b""
    try:
        while len(data) < 20 * 1024:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    conn.close()
    srv.close()
    with open(out, "wb") as f:
        f.write(data[: 20 * 1024])
    print(f"captured {len(data)} bytes to {out}")


if __name__ == "__main__":
    main()
