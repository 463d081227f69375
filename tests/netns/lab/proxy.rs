//! Starting, signalling and stopping the Palisade process of a lab.

use super::*;

impl Lab {
    /// Launch `palisade run -c CONFIG` in the proxy namespace (not waiting).
    pub fn spawn_proxy(&mut self) {
        assert!(self.proxy.is_none(), "proxy already running");
        let stdout = fs::File::create(self.dir.join("palisade.stdout")).unwrap();
        let stderr = fs::File::create(self.dir.join("palisade.stderr")).unwrap();
        // `ip netns exec` execs the command, so the child pid is Palisade's.
        let mut cmd = match &self.evidence_tmpfs {
            None => Command::new("ip"),
            Some(size) => {
                // unshare and sh exec in place: the child pid stays Palisade's.
                let mut c = Command::new("unshare");
                c.args(["-m", "--propagation", "private", "sh", "-c"])
                    .arg(format!(
                        "mount -t tmpfs -o size={size},mode=0700 palisade-test \"$0\" && exec ip \"$@\""
                    ))
                    .arg(&self.evidence_dir);
                c
            }
        };
        let child = sanitize(
            cmd.args(["netns", "exec", &self.ns_proxy, palisade_bin(), "run", "-c"])
                .arg(&self.config_path),
        )
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("spawn palisade");
        self.proxy = Some(child);
    }

    pub fn proxy_output(&self) -> String {
        read_logs(&[
            self.dir.join("palisade.stdout"),
            self.dir.join("palisade.stderr"),
        ])
    }

    /// HTTP status of GET http://ADMIN/path from inside the proxy namespace
    /// (0 when the connection failed).
    pub fn admin_status(&self, path: &str) -> u16 {
        self.proxy_ns_status(&format!("http://{ADMIN_ADDR}{path}"))
    }

    /// HTTP status of GET `url` from inside the proxy namespace (0 when the
    /// connection failed).
    pub fn proxy_ns_status(&self, url: &str) -> u16 {
        let out = self.exec(
            &self.ns_proxy.clone(),
            "curl",
            &[
                "-q",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
                url,
            ],
        );
        out.stdout.trim().parse().unwrap_or(0)
    }

    /// Poll /readyz until 200 (bounded), failing if Palisade exits.
    pub fn wait_proxy_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(st) = self.proxy.as_mut().expect("proxy").try_wait().unwrap() {
                panic!(
                    "palisade exited during start-up ({st})\n{}",
                    self.proxy_output()
                );
            }
            if self.admin_status("/readyz") == 200 {
                return;
            }
            thread::sleep(POLL);
        }
        panic!(
            "palisade /readyz not 200 within {READY_TIMEOUT:?}\n{}",
            self.proxy_output()
        );
    }

    /// Run a command in Palisade's own mount namespace (where a tmpfs
    /// evidence dir is visible), via nsenter.
    pub fn proxy_mnt_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        let pid = self.proxy_pid().to_string();
        run_with_timeout(
            Command::new("nsenter")
                .args(["-t", &pid, "-m", "--", prog])
                .args(args),
            None,
            CMD_TIMEOUT,
        )
    }

    /// SIGKILL Palisade and reap it (a crash).
    pub fn kill_proxy_hard(&mut self) {
        let mut p = self.proxy.take().expect("proxy running");
        let _ = p.kill();
        let _ = p.wait();
    }

    /// Start Palisade again after it exited, and wait until it is ready.
    pub fn restart_proxy(&mut self) {
        if let Some(mut p) = self.proxy.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
        self.spawn_proxy();
        self.wait_proxy_ready();
    }

    /// Start a shell script in the client namespace in the background,
    /// its stdout going to `out`.
    pub fn client_spawn(&self, script: &str, out: &Path) -> Child {
        let stdout = fs::File::create(out).expect("create output");
        sanitize(Command::new("ip").args(["netns", "exec", &self.ns_client, "bash", "-c", script]))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn client script")
    }

    pub fn proxy_pid(&self) -> u32 {
        self.proxy.as_ref().expect("proxy running").id()
    }

    /// Wait (bounded) for Palisade to exit; None if it is still running.
    pub fn wait_proxy_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.proxy.as_mut().expect("proxy spawned");
        loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal_proxy(&self, sig: &str) {
        must(
            Command::new("kill")
                .arg(sig)
                .arg(self.proxy_pid().to_string()),
        );
    }
}
