//! Network namespaces: listing, removing stale ones, entering one.

use super::*;

pub(super) fn ip(args: &[&str]) -> CmdOutput {
    must(Command::new("ip").args(args))
}

pub(super) fn netns_list() -> Vec<String> {
    let out = must(Command::new("ip").args(["netns", "list"]));
    out.stdout
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

pub(super) fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Kill every process inside `ns` and delete it.  Never panics.
pub(super) fn destroy_ns(ns: &str) {
    for sig in ["-TERM", "-KILL"] {
        let pids = Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let pids: Vec<&str> = pids.split_whitespace().collect();
        if pids.is_empty() {
            break;
        }
        let _ = Command::new("kill").arg(sig).args(&pids).output();
        for _ in 0..40 {
            if pids
                .iter()
                .all(|p| !Path::new(&format!("/proc/{p}")).exists())
            {
                break;
            }
            thread::sleep(Duration::from_millis(25));
        }
    }
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
}

/// Remove namespaces left behind by earlier test processes that died.
pub(super) fn clean_stale_namespaces() {
    for ns in netns_list() {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let owner = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        match owner {
            Some(pid) if pid == std::process::id() || pid_alive(pid) => {}
            _ => destroy_ns(&ns),
        }
    }
}

/// Remove scratch directories of earlier test processes that are gone.
pub(super) fn clean_stale_scratch() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("palisade-netns-") else {
            continue;
        };
        let pid = rest.split_once('-').map_or(rest, |(pid, _)| pid);
        match pid.parse::<u32>() {
            Ok(pid) if pid != std::process::id() && !pid_alive(pid) => {
                let _ = fs::remove_dir_all(e.path());
            }
            _ => {}
        }
    }
}

/// Run `f` on a fresh thread inside network namespace `ns`.  Sockets created
/// there stay in that namespace when handed back to other threads.
pub(crate) fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    let file = fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    thread::spawn(move || {
        // SAFETY: setns(2) takes a file descriptor and a flag; `file` is an
        // open namespace file that outlives the call, so the fd is valid.
        // CLONE_NEWNET only switches the calling thread's network namespace
        // (allowed in a multi-threaded process), and this thread is ours
        // alone and ends when `f` returns.  No memory is shared or aliased.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread panicked")
}
