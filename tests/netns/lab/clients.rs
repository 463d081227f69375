//! Clients in the lab namespaces: commands, curl, dig, raw requests and connections.

use super::*;

impl Lab {
    /// Run a program inside a namespace with the default timeout.
    pub fn exec(&self, ns: &str, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec_input(ns, prog, args, None)
    }

    pub fn exec_input(
        &self,
        ns: &str,
        prog: &str,
        args: &[&str],
        input: Option<&[u8]>,
    ) -> CmdOutput {
        run_with_timeout(
            Command::new("ip")
                .args(["netns", "exec", ns, prog])
                .args(args),
            input,
            CMD_TIMEOUT,
        )
    }

    /// Start a Python script in the client namespace, in the background,
    /// and wait for the first line it prints (it says it is ready, and how).
    /// Kill the child when done.
    pub fn spawn_client_script(
        &self,
        script: &str,
        args: &[&str],
    ) -> (std::process::Child, String) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns_client, "python3", "-c", script])
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start python3 in the client namespace");
        let mut line = String::new();
        if let Some(out) = child.stdout.as_mut() {
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line);
        }
        (child, line.trim().to_string())
    }

    /// Start a server of a test's own in the upstream namespace (`prog`
    /// with `args`), in the background, and wait until it prints "ready"
    /// (`what` names it if it does not). Killed when dropped.
    pub fn spawn_upstream_server<S: AsRef<std::ffi::OsStr>>(
        &self,
        what: &str,
        prog: &str,
        args: impl IntoIterator<Item = S>,
    ) -> Background {
        self.spawn_server_in(&self.ns_upstream, what, prog, args)
    }

    /// Start a server of a test's own in namespace `ns` (`prog` with
    /// `args`), in the background, and wait until it prints "ready" (`what`
    /// names it if it does not). Killed when dropped.
    pub fn spawn_server_in<S: AsRef<std::ffi::OsStr>>(
        &self,
        ns: &str,
        what: &str,
        prog: &str,
        args: impl IntoIterator<Item = S>,
    ) -> Background {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, prog])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {what}: {e}"));
        let mut line = String::new();
        if let Some(out) = child.stdout.as_mut() {
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line);
        }
        let server = Background(child);
        assert_eq!(line.trim(), "ready", "{what} did not start");
        server
    }

    pub(super) fn exec_must(&self, ns: &str, prog: &str, args: &[&str]) -> CmdOutput {
        let out = self.exec(ns, prog, args);
        assert!(
            out.success(),
            "{prog} {args:?} in {ns} failed\n{}",
            out.describe()
        );
        out
    }

    pub fn client_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec(&self.ns_client, prog, args)
    }

    pub fn proxy_ns_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec(&self.ns_proxy, prog, args)
    }

    /// Datagrams dropped so far because a UDP socket's receive buffer in
    /// the shim's namespace was full: they never reached the shim.
    pub fn shim_rcvbuf_drops(&self) -> u64 {
        let out = self.proxy_ns_exec("cat", &["/proc/net/snmp"]);
        let udp: Vec<&str> = out
            .stdout
            .lines()
            .filter(|l| l.starts_with("Udp:"))
            .collect();
        let (names, values) = (udp[0], udp[1]);
        let at = names
            .split_whitespace()
            .position(|n| n == "RcvbufErrors")
            .expect("RcvbufErrors in /proc/net/snmp");
        values.split_whitespace().nth(at).unwrap().parse().unwrap()
    }

    /// Run curl in the client namespace (`-q -sS --max-time 10` plus `args`).
    pub fn client_curl(&self, args: &[&str]) -> HttpResp {
        self.curl_in(&self.ns_client.clone(), args)
    }

    pub fn curl_in(&self, ns: &str, args: &[&str]) -> HttpResp {
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        let body = self.dir.join(format!("curl-{n}.body"));
        let head = self.dir.join(format!("curl-{n}.head"));
        let body_s = body.display().to_string();
        let head_s = head.display().to_string();
        let mut full: Vec<&str> = vec![
            "-q",
            "-sS",
            "--max-time",
            "10",
            "-o",
            &body_s,
            "-D",
            &head_s,
            "-w",
            "%{http_connect} %{local_port}",
        ];
        full.extend_from_slice(args);
        let out = self.exec(ns, "curl", &full);
        let head_text = fs::read_to_string(&head).unwrap_or_default();
        let (status, headers) = parse_heads(&head_text);
        let mut w = out.stdout.split_whitespace();
        let connect_status = w.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let local_port = w.next().and_then(|s| s.parse().ok()).filter(|p| *p != 0);
        HttpResp {
            status,
            headers,
            body: fs::read_to_string(&body).unwrap_or_default(),
            exit: out.code(),
            stderr: out.stderr,
            connect_status,
            local_port,
        }
    }

    /// curl through the proxy from the org client address.
    pub fn proxied_curl(&self, url: &str, extra: &[&str]) -> HttpResp {
        let ca = ca_pem().display().to_string();
        let mut args: Vec<&str> = vec!["-x", PROXY_URL, "--cacert", &ca];
        args.extend_from_slice(extra);
        args.push(url);
        self.client_curl(&args)
    }

    /// Send raw bytes to the proxy from `source` (client namespace) and parse
    /// the response.
    pub fn raw_request_from(&self, source: &str, request: &str) -> HttpResp {
        let script = fixtures_dir().join("rawhttp.py").display().to_string();
        let out = self.exec_input(
            &self.ns_client.clone(),
            "python3",
            &[&script, "--connect", PROXY_ADDR, "--source", source],
            Some(request.as_bytes()),
        );
        let (head, body) = out
            .stdout
            .split_once("\r\n\r\n")
            .unwrap_or((out.stdout.as_str(), ""));
        let (status, headers) = parse_heads(head);
        HttpResp {
            status,
            headers,
            body: body.to_owned(),
            exit: out.code(),
            stderr: out.stderr,
            connect_status: 0,
            local_port: None,
        }
    }

    pub fn raw_request(&self, request: &str) -> HttpResp {
        self.raw_request_from(CLIENT_IP, request)
    }

    /// `CONNECT target HTTP/1.1` sent raw, so the refusal body can be read.
    pub fn raw_connect(&self, target: &str) -> HttpResp {
        self.raw_request(&format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n"
        ))
    }

    /// Run `dig +time=2 +tries=1 ARGS` in a namespace and parse its output.
    pub fn dig_in(&self, ns: &str, args: &[&str]) -> Dig {
        let mut full: Vec<&str> = vec!["+time=2", "+tries=1", "+nocookie"];
        full.extend_from_slice(args);
        let out = self.exec(ns, "dig", &full);
        Dig::parse(&out.stdout, out.code())
    }

    /// `dig @SHIM_IP ARGS` from the org client namespace.
    pub fn dig(&self, args: &[&str]) -> Dig {
        let server = format!("@{SHIM_IP}");
        let mut full: Vec<&str> = vec![&server];
        full.extend_from_slice(args);
        self.dig_in(&self.ns_client.clone(), &full)
    }

    /// Raw DNS messages (hex) sent to the shim from the client namespace;
    /// one result line per message (see tests/fixtures/dnsraw.py).
    pub fn dns_raw(&self, proto: &str, hex: &[&str]) -> Vec<String> {
        let script = fixtures_dir().join("dnsraw.py").display().to_string();
        let mut args: Vec<&str> = vec![&script, "--server", SHIM_IP, "--proto", proto];
        args.extend_from_slice(hex);
        let out = self.exec(&self.ns_client.clone(), "python3", &args);
        assert!(out.success(), "dnsraw.py failed\n{}", out.describe());
        out.stdout.lines().map(str::to_owned).collect()
    }

    /// Open a TCP connection to the proxy from the client namespace (source
    /// CLIENT_IP), held by the test itself for tests that need timing or
    /// several requests on one connection.
    pub fn client_conn(&self) -> RawConn {
        self.try_client_conn()
            .unwrap_or_else(|e| panic!("connect to {PROXY_ADDR}: {e}\n{}", self.proxy_output()))
    }

    /// Like [`Lab::client_conn`], but a failure to connect is returned.
    pub fn try_client_conn(&self) -> io::Result<RawConn> {
        self.try_client_conn_to(PROXY_ADDR)
    }

    /// A connection from the client namespace to `addr` ("ip:port"): another
    /// listener of the proxy (SOCKS5), or any address when the client's
    /// traffic goes through the transparent gateway.
    pub fn client_conn_to(&self, addr: &str) -> RawConn {
        self.try_client_conn_to(addr)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}\n{}", self.proxy_output()))
    }

    /// Like [`Lab::client_conn_to`], but a failure to connect is returned.
    pub fn try_client_conn_to(&self, addr: &str) -> io::Result<RawConn> {
        let addr: SocketAddr = addr.parse().expect("ip:port");
        let stream = in_netns(&self.ns_client, move || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        })?;
        let conn = RawConn::new(stream);
        conn.stream.set_nodelay(true)?;
        Ok(conn)
    }
}

/// A process of a test's own, killed when dropped.
pub struct Background(pub Child);

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
