//! Running commands with a timeout, and the test binary, fixture and scratch paths.

use super::*;

pub(crate) fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub(crate) fn palisade_bin() -> &'static str {
    env!("CARGO_BIN_EXE_palisade")
}

/// Per-process scratch directory under the system temp dir,
/// `palisade-netns-PID-` and a random suffix (see `clean_stale_scratch`).
pub(crate) fn scratch_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        tempfile::Builder::new()
            .prefix(&format!("palisade-netns-{}-", std::process::id()))
            .tempdir()
            .expect("create scratch root")
            .into_path()
    })
}

/// Fresh empty directory for one test, kept after it for `dump` and a look.
pub(crate) fn scratch_dir(tag: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("{tag}-"))
        .tempdir_in(scratch_root())
        .expect("create scratch dir")
        .into_path()
}

/// These tests need CAP_NET_ADMIN and CAP_SYS_ADMIN: fail loudly, never skip.
pub(crate) fn require_root() {
    let status = fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .expect("Uid line in /proc/self/status");
    assert_eq!(
        euid, "0",
        "the netns integration tests must run as root (they create network namespaces); \
         run them via .ci/run or `sudo -E cargo test --test netns`"
    );
}

/// Output of a command that was run with a deadline.
#[derive(Debug)]
pub struct CmdOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
    pub fn success(&self) -> bool {
        self.status.success()
    }
    pub fn describe(&self) -> String {
        format!(
            "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Strip proxy variables from `cmd`'s environment: test clients connect
/// only where they are told to.
pub(crate) fn sanitize(cmd: &mut Command) -> &mut Command {
    for var in [
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "no_proxy",
        "NO_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Run `cmd` with `stdin` fed to it, killing it after `timeout`.
pub(crate) fn run_with_timeout(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> CmdOutput {
    sanitize(cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {desc}: {e}"));
    if let Some(input) = stdin {
        use std::io::Write;
        let mut pipe = child.stdin.take().expect("stdin pipe");
        let input = input.to_vec();
        // Written from a thread so a child that does not read cannot block us.
        thread::spawn(move || {
            let _ = pipe.write_all(&input);
        });
    }
    let mut out_pipe = child.stdout.take().expect("stdout pipe");
    let mut err_pipe = child.stderr.take().expect("stderr pipe");
    let out_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait().expect("try_wait") {
            Some(st) => break st,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("command timed out after {timeout:?}: {desc}");
            }
            None => thread::sleep(Duration::from_millis(10)),
        }
    };
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap_or_default()).into_owned();
    CmdOutput {
        status,
        stdout,
        stderr,
    }
}

/// Run a command that must succeed (harness plumbing).
pub(crate) fn must(cmd: &mut Command) -> CmdOutput {
    let desc = format!("{cmd:?}");
    let out = run_with_timeout(cmd, None, CMD_TIMEOUT);
    assert!(out.success(), "{desc} failed\n{}", out.describe());
    out
}
