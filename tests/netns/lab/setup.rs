//! Building a lab: namespaces, veth links, fixtures, certificates, the proxy config.

use super::*;

/// Test CA + server certificate, generated once per test process.
pub(crate) fn certs_dir() -> &'static Path {
    CERTS.get_or_init(|| {
        clean_stale_scratch();
        let dir = scratch_root().join("certs");
        let _ = fs::remove_dir_all(&dir);
        must(
            Command::new("bash")
                .arg(fixtures_dir().join("gen-certs.sh"))
                .arg(&dir),
        );
        dir
    })
}

pub(crate) fn ca_pem() -> PathBuf {
    certs_dir().join("ca.pem")
}

pub(super) fn wait_for_file(path: &Path, child: &mut Child, what: &str, logs: &[PathBuf]) {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        if path.exists() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited during start-up ({st}):\n{}", read_logs(logs));
        }
        thread::sleep(POLL);
    }
    panic!(
        "{what} not ready within {READY_TIMEOUT:?}:\n{}",
        read_logs(logs)
    );
}

pub(super) fn read_logs(paths: &[PathBuf]) -> String {
    let mut s = String::new();
    for p in paths {
        let _ = writeln!(
            s,
            "--- {} ---\n{}",
            p.display(),
            fs::read_to_string(p).unwrap_or_default()
        );
    }
    s
}

impl Lab {
    pub fn builder() -> LabBuilder {
        LabBuilder {
            policy: DEFAULT_POLICY.to_owned(),
            proxy_listen: vec![PROXY_ADDR.to_owned()],
            admin_listen: ADMIN_ADDR.to_owned(),
            admin_lines: String::new(),
            proxy_options: Vec::new(),
            start_proxy: true,
            dns_listen: Vec::new(),
            dns_extra: String::new(),
            second_client: false,
            evidence_lines: String::new(),
            evidence_tmpfs: None,
            intercept_lines: String::new(),
            untrusted_upstream: false,
            ipv6: false,
            dns_records: Vec::new(),
        }
    }

    /// Lab with the given policy fragment (`[[org]]` tables) and a running,
    /// ready Palisade.
    pub fn start(policy: &str) -> Lab {
        Lab::builder().policy(policy).start()
    }

    pub(super) fn create(b: LabBuilder) -> Lab {
        require_root();
        let certs = certs_dir().to_path_buf();
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let id = format!("{NS_PREFIX}{}-{n}", std::process::id());
        let dir = scratch_dir("lab");
        let evidence_dir = dir.join("evidence");
        fs::create_dir_all(&evidence_dir).expect("create evidence dir");
        let mut lab = Lab {
            ns_client: format!("{id}-c"),
            ns_client2: if b.second_client {
                format!("{id}-d")
            } else {
                String::new()
            },
            ns_proxy: format!("{id}-p"),
            ns_upstream: format!("{id}-u"),
            config_path: dir.join("palisade.toml"),
            id,
            dir,
            evidence_dir,
            fixtures: Vec::new(),
            proxy: None,
            namespaces: Vec::new(),
            seq: AtomicU32::new(0),
            evidence_tmpfs: b.evidence_tmpfs.clone(),
            ipv6: b.ipv6,
        };
        {
            // `ip netns add` mounts /run/netns on first use; serialise the
            // plumbing so parallel tests do not race on it.
            let _guard = SETUP_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            static CLEANED: OnceLock<()> = OnceLock::new();
            CLEANED.get_or_init(clean_stale_namespaces);
            lab.build_network();
        }
        lab.start_fixtures(&certs, &b.dns_records);
        if b.untrusted_upstream {
            lab.start_untrusted_upstream(&certs);
        }
        let cfg = lab.config_toml(&b);
        fs::write(&lab.config_path, cfg).expect("write config");
        if b.start_proxy {
            lab.spawn_proxy();
            lab.wait_proxy_ready();
        }
        lab
    }

    pub(super) fn build_network(&mut self) {
        let (c, p, u) = (
            self.ns_client.clone(),
            self.ns_proxy.clone(),
            self.ns_upstream.clone(),
        );
        for ns in [&c, &p, &u] {
            ip(&["netns", "add", ns]);
            self.namespaces.push(ns.clone());
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        // veths are created inside the lab namespaces: nothing ever appears
        // in the root namespace.
        ip(&[
            "-n", &p, "link", "add", "p0", "type", "veth", "peer", "name", "c0", "netns", &c,
        ]);
        ip(&[
            "-n", &p, "link", "add", "u0", "type", "veth", "peer", "name", "u1", "netns", &u,
        ]);
        ip(&["-n", &c, "addr", "add", "198.18.1.2/24", "dev", "c0"]);
        ip(&["-n", &c, "addr", "add", "198.18.3.2/32", "dev", "c0"]);
        ip(&["-n", &p, "addr", "add", "198.18.1.1/24", "dev", "p0"]);
        ip(&["-n", &p, "addr", "add", "198.18.2.1/24", "dev", "u0"]);
        ip(&["-n", &u, "addr", "add", "198.18.2.2/24", "dev", "u1"]);
        for a in WEB_IPS {
            ip(&["-n", &u, "addr", "add", &format!("{a}/32"), "dev", "u1"]);
        }
        ip(&["-n", &c, "link", "set", "c0", "up"]);
        ip(&["-n", &p, "link", "set", "p0", "up"]);
        ip(&["-n", &p, "link", "set", "u0", "up"]);
        ip(&["-n", &u, "link", "set", "u1", "up"]);
        // Replies to the stranger address go back over the same link.
        ip(&["-n", &p, "route", "add", "198.18.3.2/32", "dev", "p0"]);
        if !self.ns_client2.is_empty() {
            let d = self.ns_client2.clone();
            ip(&["netns", "add", &d]);
            self.namespaces.push(d.clone());
            ip(&["-n", &d, "link", "set", "lo", "up"]);
            ip(&[
                "-n", &p, "link", "add", "p1", "type", "veth", "peer", "name", "d0", "netns", &d,
            ]);
            ip(&["-n", &p, "addr", "add", "198.18.4.1/24", "dev", "p1"]);
            ip(&["-n", &d, "addr", "add", "198.18.4.2/24", "dev", "d0"]);
            ip(&["-n", &p, "link", "set", "p1", "up"]);
            ip(&["-n", &d, "link", "set", "d0", "up"]);
            ip(&["-n", &d, "route", "add", "default", "via", "198.18.4.1"]);
        }
        // New namespaces may inherit ip_forward from the root namespace.
        self.exec_must(&p, "sh", &["-c", "echo 0 > /proc/sys/net/ipv4/ip_forward"]);
        if self.ipv6 {
            self.build_ipv6();
        }
    }

    /// The IPv6 side ([`LabBuilder::ipv6`]): no duplicate address detection
    /// (`nodad`), so every address is usable at once; the gateway forwards
    /// nothing.
    fn build_ipv6(&mut self) {
        let (c, p, u) = (
            self.ns_client.clone(),
            self.ns_proxy.clone(),
            self.ns_upstream.clone(),
        );
        for ns in [&c, &p, &u] {
            self.exec_must(
                ns,
                "sh",
                &["-c", "echo 0 > /proc/sys/net/ipv6/conf/all/disable_ipv6"],
            );
        }
        self.exec_must(
            &p,
            "sh",
            &["-c", "echo 0 > /proc/sys/net/ipv6/conf/all/forwarding"],
        );
        let addr = |ns: &str, a: &str, dev: &str| {
            ip(&["-n", ns, "addr", "add", a, "dev", dev, "nodad"]);
        };
        addr(&c, &format!("{CLIENT_IP6}/64"), "c0");
        addr(&p, &format!("{GATEWAY_IP6}/64"), "p0");
        addr(&p, "2001:2:2::1/64", "u0");
        addr(&u, &format!("{DNS_IP6}/64"), "u1");
        for (a, _) in V6_WEB {
            addr(&u, &format!("{a}/128"), "u1");
        }
        // The unique-local host is off the upstream link's prefix.
        ip(&[
            "-n",
            &p,
            "-6",
            "route",
            "add",
            "fd00:2::/64",
            "via",
            DNS_IP6,
            "dev",
            "u0",
        ]);
        // A sandbox packet the gateway forwarded (it must not) could be
        // answered, and its connection would show in the upstream's log.
        ip(&[
            "-n",
            &u,
            "-6",
            "route",
            "add",
            "2001:2:1::/64",
            "via",
            "2001:2:2::1",
            "dev",
            "u1",
        ]);
    }

    pub(super) fn start_fixtures(&mut self, certs: &Path, records: &[(String, String)]) {
        let fx = fixtures_dir();
        let mut dns_args: Vec<String> = vec![
            fx.join("dns.py").display().to_string(),
            "serve".into(),
            "--listen".into(),
            DNS_IP.into(),
            "--log".into(),
            self.dns_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("dns.ready").display().to_string(),
        ];
        for (name, addr) in DNS_RECORDS {
            dns_args.push("--a".into());
            dns_args.push(format!("{name}={addr}"));
        }
        for (name, addr) in records {
            dns_args.push("--a".into());
            dns_args.push(format!("{name}={addr}"));
        }
        for (flag, spec) in DNS_EXTRA {
            dns_args.push((*flag).into());
            dns_args.push((*spec).into());
        }
        if self.ipv6 {
            dns_args.extend(["--listen".into(), DNS_IP6.into()]);
            for (addr, name) in V6_WEB {
                if let Some(name) = name {
                    dns_args.extend(["--aaaa".into(), format!("{name}={addr}")]);
                }
            }
        }
        let ns_u = self.ns_upstream.clone();
        self.spawn_fixture("dns", &ns_u, &dns_args);

        let mut web_args: Vec<String> = vec![
            fx.join("upstream.py").display().to_string(),
            "--cert".into(),
            certs.join("server.pem").display().to_string(),
            "--key".into(),
            certs.join("server.key").display().to_string(),
            "--log".into(),
            self.upstream_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("web.ready").display().to_string(),
            "--banner-port".into(),
            BANNER_PORT.to_string(),
        ];
        for a in WEB_IPS {
            web_args.push("--addr".into());
            web_args.push((*a).into());
        }
        if self.ipv6 {
            for (a, _) in V6_WEB {
                web_args.extend(["--addr".into(), (*a).into()]);
            }
        }
        self.spawn_fixture("web", &ns_u, &web_args);

        // Canary on the proxy namespace's loopback: Palisade must never dial it.
        let canary_args: Vec<String> = vec![
            fx.join("upstream.py").display().to_string(),
            "--addr".into(),
            "127.0.0.1".into(),
            "--cert".into(),
            certs.join("server.pem").display().to_string(),
            "--key".into(),
            certs.join("server.key").display().to_string(),
            "--log".into(),
            self.canary_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("canary.ready").display().to_string(),
        ];
        let ns_p = self.ns_proxy.clone();
        self.spawn_fixture("canary", &ns_p, &canary_args);

        for name in ["dns", "web", "canary"] {
            let ready = self.dir.join(format!("{name}.ready"));
            let logs = [
                self.dir.join(format!("{name}.stdout")),
                self.dir.join(format!("{name}.stderr")),
            ];
            let child = &mut self
                .fixtures
                .iter_mut()
                .find(|(n, _)| n == name)
                .expect("fixture")
                .1;
            wait_for_file(&ready, child, name, &logs);
        }
    }

    pub(super) fn start_untrusted_upstream(&mut self, certs: &Path) {
        let ns_u = self.ns_upstream.clone();
        ip(&[
            "-n",
            &ns_u,
            "addr",
            "add",
            &format!("{UNTRUSTED_IP}/32"),
            "dev",
            "u1",
        ]);
        let args: Vec<String> = vec![
            fixtures_dir().join("upstream.py").display().to_string(),
            "--addr".into(),
            UNTRUSTED_IP.into(),
            "--cert".into(),
            certs.join("rogue.pem").display().to_string(),
            "--key".into(),
            certs.join("rogue.key").display().to_string(),
            "--log".into(),
            self.dir.join("untrusted.log").display().to_string(),
            "--ready".into(),
            self.dir.join("untrusted.ready").display().to_string(),
        ];
        self.spawn_fixture("untrusted", &ns_u, &args);
        let ready = self.dir.join("untrusted.ready");
        let logs = [
            self.dir.join("untrusted.stdout"),
            self.dir.join("untrusted.stderr"),
        ];
        let child = &mut self
            .fixtures
            .iter_mut()
            .find(|(n, _)| n == "untrusted")
            .expect("fixture")
            .1;
        wait_for_file(&ready, child, "untrusted", &logs);
    }

    pub(super) fn spawn_fixture(&mut self, name: &str, ns: &str, args: &[String]) {
        let stdout = fs::File::create(self.dir.join(format!("{name}.stdout"))).unwrap();
        let stderr = fs::File::create(self.dir.join(format!("{name}.stderr"))).unwrap();
        let child = sanitize(
            Command::new("ip")
                .args(["netns", "exec", ns, "python3"])
                .args(args),
        )
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn fixture {name}: {e}"));
        self.fixtures.push((name.to_owned(), child));
    }

    pub(super) fn config_toml(&self, b: &LabBuilder) -> String {
        let listen: Vec<String> = b.proxy_listen.iter().map(|a| format!("{a:?}")).collect();
        let options: String = b.proxy_options.iter().map(|l| format!("{l}\n")).collect();
        let dns_listen: Vec<String> = b.dns_listen.iter().map(|a| format!("{a:?}")).collect();
        let intercept = if b.intercept_lines.is_empty() {
            String::new()
        } else {
            format!("[intercept]\n{}\n", b.intercept_lines)
        };
        format!(
            "[proxy]\nlisten = [{}]\n{options}\n[dns]\nlisten = [{}]\nupstream = [\"{DNS_IP}:53\"]\n{}\n\
             [admin]\nlisten = {:?}\n{}\n{intercept}[evidence]\ndir = {:?}\n{}\n{}\n",
            listen.join(", "),
            dns_listen.join(", "),
            b.dns_extra,
            b.admin_listen,
            b.admin_lines,
            self.evidence_dir.display().to_string(),
            b.evidence_lines,
            b.policy
        )
    }
}
