//! The command section of a git `receive-pack` request (a push over smart
//! HTTP): pure, over the request body's first bytes.
//!
//! The body of `POST …/git-receive-pack` starts with pkt-lines
//! (gitprotocol-common(5): four hex digits giving the line's length,
//! the four included, then the payload; `0000` is a flush-pkt), then the
//! pack:
//!
//! ```text
//! [shallow <oid>]...            (a push from a shallow clone)
//! <old-oid> <new-oid> <ref>\0<capabilities>
//! <old-oid> <new-oid> <ref>...
//! 0000                          (flush: the end of the commands)
//! [push options, flush]         (with the push-options capability)
//! PACK…                         (unless every command is a delete)
//! ```
//!
//! [`read_commands`] reads up to and including the first flush and answers
//! done (the ref updates, and how many bytes the section took), need more
//! bytes, or malformed. It never panics and holds at most
//! [`MAX_COMMAND_BYTES`]: a section longer than that is malformed, and so
//! is anything this reader does not know, which the caller refuses rather
//! than forwards: a signed push (`push-cert`), pkt-lines of protocol v2
//! (`0001`, `0002`), a ref name git itself would refuse
//! (git-check-ref-format(1)), object ids of mixed length.

/// The longest command section read (bytes); beyond it the push is
/// refused. A push of a few thousand refs fits.
pub(crate) const MAX_COMMAND_BYTES: usize = 1024 * 1024;
/// The most ref updates in one push.
pub(crate) const MAX_COMMANDS: usize = 10_000;
/// The longest pkt-line (gitprotocol-common(5): 65520 bytes in all).
const MAX_PKT_LEN: usize = 65520;
/// The longest ref name accepted.
const MAX_REF_LEN: usize = 1024;

/// One ref update command of a push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RefUpdate {
    /// The object the ref has now (all zeros: the ref is created).
    pub(crate) old: String,
    /// The object it is to have (all zeros: the ref is deleted).
    pub(crate) new: String,
    /// The full ref name, `refs/…`.
    pub(crate) name: String,
}

/// What a ref update does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpdateKind {
    Create,
    Update,
    Delete,
}

impl UpdateKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            UpdateKind::Create => "create",
            UpdateKind::Update => "update",
            UpdateKind::Delete => "delete",
        }
    }
}

impl RefUpdate {
    pub(crate) fn kind(&self) -> UpdateKind {
        let zero = |oid: &str| oid.bytes().all(|b| b == b'0');
        if zero(&self.new) {
            UpdateKind::Delete
        } else if zero(&self.old) {
            UpdateKind::Create
        } else {
            UpdateKind::Update
        }
    }
}

/// What [`read_commands`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Commands {
    /// The whole section: its updates, and the bytes it took (through the
    /// flush).
    Done { updates: Vec<RefUpdate>, len: usize },
    /// The section has not ended yet: read more.
    NeedMore,
    /// Not a command section this reader accepts: refuse the push.
    Malformed(String),
}

/// Read the command section of a receive-pack request body from its
/// first bytes `buf`. See the module's documentation.
pub(crate) fn read_commands(buf: &[u8]) -> Commands {
    let bad = |why: &str| Commands::Malformed(why.to_string());
    let mut pos = 0;
    let mut updates = Vec::new();
    loop {
        if pos > MAX_COMMAND_BYTES {
            return bad("the command section is longer than 1 MiB");
        }
        let Some(head) = buf.get(pos..pos + 4) else {
            return more_or_too_long(buf);
        };
        let Some(len) = hex4(head) else {
            return bad("a pkt-line length is not four hex digits");
        };
        if len == 0 {
            if updates.is_empty() {
                return bad("the push names no ref");
            }
            return Commands::Done {
                updates,
                len: pos + 4,
            };
        }
        if len < 4 {
            return bad("a delim or response-end pkt-line (protocol v2) in a push");
        }
        if len > MAX_PKT_LEN {
            return bad("a pkt-line longer than 65520 bytes");
        }
        let Some(payload) = buf.get(pos + 4..pos + len) else {
            return more_or_too_long(buf);
        };
        pos += len;
        let line = payload.strip_suffix(b"\n").unwrap_or(payload);
        // Capabilities follow the first command after a NUL.
        let (line, caps) = match line.iter().position(|&b| b == 0) {
            Some(i) if updates.is_empty() => (&line[..i], Some(&line[i + 1..])),
            Some(_) => return bad("a NUL after the first command"),
            None => (line, None),
        };
        if line == b"push-cert" {
            return bad("signed pushes (push-cert) are not supported");
        }
        if let Some(oid) = line.strip_prefix(b"shallow ") {
            if !updates.is_empty() || caps.is_some() || !is_oid(oid) {
                return bad("a malformed shallow line");
            }
            continue;
        }
        if updates.len() >= MAX_COMMANDS {
            return bad("more than 10000 ref updates in one push");
        }
        match command(line) {
            Ok(u) => updates.push(u),
            Err(why) => return Commands::Malformed(why),
        }
    }
}

fn more_or_too_long(buf: &[u8]) -> Commands {
    if buf.len() > MAX_COMMAND_BYTES {
        Commands::Malformed("the command section is longer than 1 MiB".into())
    } else {
        Commands::NeedMore
    }
}

/// Four hex digits (either case), as a length.
fn hex4(b: &[u8]) -> Option<usize> {
    b.iter().try_fold(0usize, |acc, &c| {
        let d = (c as char).to_digit(16)?;
        Some(acc * 16 + d as usize)
    })
}

/// An object id: 40 (SHA-1) or 64 (SHA-256) lower-case hex digits.
fn is_oid(b: &[u8]) -> bool {
    matches!(b.len(), 40 | 64) && b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// `<old> <new> <ref>`.
fn command(line: &[u8]) -> Result<RefUpdate, String> {
    let mut parts = line.splitn(3, |&b| b == b' ');
    let (Some(old), Some(new), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err("a ref update is not \"<old> <new> <ref>\"".into());
    };
    if !is_oid(old) || !is_oid(new) || old.len() != new.len() {
        return Err("a ref update's object ids are malformed".into());
    }
    let name = std::str::from_utf8(name).map_err(|_| "a ref name is not UTF-8".to_string())?;
    if !valid_ref_name(name) {
        let shown: String = name.chars().take(120).collect();
        return Err(format!(
            "the ref name {shown:?} is not a valid full ref name"
        ));
    }
    Ok(RefUpdate {
        old: String::from_utf8_lossy(old).into_owned(),
        new: String::from_utf8_lossy(new).into_owned(),
        name: name.to_string(),
    })
}

/// A full ref name as git-check-ref-format(1) accepts it (and under
/// `refs/`): no control characters, space, `~^:?*[\`, `..`, `@{` or
/// `//`; no component that starts with `.` or ends with `.lock`; not
/// ending in `/` or `.`. What git would refuse is refused here, so the
/// name matched is the name the server updates.
pub(crate) fn valid_ref_name(name: &str) -> bool {
    name.len() <= MAX_REF_LEN
        && name.starts_with("refs/")
        && !name.ends_with('/')
        && !name.ends_with('.')
        && !name.contains("..")
        && !name.contains("@{")
        && !name.contains("//")
        && name.bytes().all(|b| {
            b > b' ' && b != 0x7f && !matches!(b, b'~' | b'^' | b':' | b'?' | b'*' | b'[' | b'\\')
        })
        && name
            .split('/')
            .all(|c| !c.is_empty() && !c.starts_with('.') && !c.ends_with(".lock"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "1111111111111111111111111111111111111111";
    const B: &str = "2222222222222222222222222222222222222222";
    const Z: &str = "0000000000000000000000000000000000000000";

    fn pkt(payload: &str) -> String {
        format!("{:04x}{payload}", payload.len() + 4)
    }

    /// A push as git sends it: the commands, a flush, a pack.
    fn push(cmds: &[(&str, &str, &str)]) -> Vec<u8> {
        let mut s = String::new();
        for (i, (o, n, r)) in cmds.iter().enumerate() {
            let caps = if i == 0 {
                "\0 report-status side-band-64k agent=git/2.47"
            } else {
                ""
            };
            s += &pkt(&format!("{o} {n} {r}{caps}\n"));
        }
        s += "0000PACK\0\0\0\x02";
        s.into_bytes()
    }

    #[test]
    fn reads_every_command_up_to_the_flush() {
        let body = push(&[
            (A, B, "refs/heads/agent/x"),
            (Z, B, "refs/heads/agent/new"),
            (A, Z, "refs/tags/old"),
        ]);
        let Commands::Done { updates, len } = read_commands(&body) else {
            panic!("{:?}", read_commands(&body));
        };
        assert_eq!(&body[len..len + 4], b"PACK");
        let kinds: Vec<_> = updates
            .iter()
            .map(|u| (u.name.as_str(), u.kind()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("refs/heads/agent/x", UpdateKind::Update),
                ("refs/heads/agent/new", UpdateKind::Create),
                ("refs/tags/old", UpdateKind::Delete),
            ]
        );
    }

    #[test]
    fn every_prefix_needs_more_and_never_panics() {
        let body = push(&[(A, B, "refs/heads/main"), (A, B, "refs/heads/x")]);
        let Commands::Done { len, .. } = read_commands(&body) else {
            panic!()
        };
        for cut in 0..len {
            assert_eq!(read_commands(&body[..cut]), Commands::NeedMore, "{cut}");
        }
        for cut in len..=body.len() {
            assert!(matches!(read_commands(&body[..cut]), Commands::Done { .. }));
        }
    }

    #[test]
    fn shallow_lines_and_sha256() {
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        let body = format!(
            "{}{}0000",
            pkt(&format!("shallow {}", "c".repeat(40))),
            pkt(&format!("{a} {b} refs/heads/agent/y\0 report-status\n"))
        );
        let Commands::Done { updates, .. } = read_commands(body.as_bytes()) else {
            panic!()
        };
        assert_eq!(updates[0].name, "refs/heads/agent/y");
    }

    #[test]
    fn malformed_sections_are_refused() {
        let bad = |b: &[u8]| matches!(read_commands(b), Commands::Malformed(_));
        assert!(bad(b"0000"));
        assert!(bad(b"zz00"));
        assert!(bad(b"0001"));
        assert!(bad(b"0003"));
        assert!(bad(b"fff5"));
        assert!(bad(pkt("push-cert\0 report-status\n").as_bytes()));
        assert!(bad(pkt(&format!("{A} {B}\n")).as_bytes()));
        assert!(bad(
            pkt(&format!("{A} {} refs/heads/x\n", "2".repeat(64))).as_bytes()
        ));
        assert!(bad(
            pkt(&format!("{} {B} refs/heads/x\n", "A".repeat(40))).as_bytes()
        ));
        // A NUL after the first command: capabilities only come first.
        let two =
            pkt(&format!("{A} {B} refs/heads/a\n")) + &pkt(&format!("{A} {B} refs/heads/b\0x\n"));
        assert!(bad(two.as_bytes()));
        for name in [
            "refs/heads/a/../main",
            "refs/heads/a..b",
            "refs/heads/.hidden",
            "refs/heads/x.lock",
            "refs/heads/x/",
            "refs/heads/x.",
            "refs/heads//x",
            "refs/heads/a b",
            "refs/heads/a\tb",
            "refs/heads/a~1",
            "refs/heads/a^",
            "refs/heads/a:b",
            "refs/heads/a*",
            "refs/heads/a[",
            "refs/heads/a\\b",
            "refs/heads/a@{1}",
            "HEAD",
            "heads/main",
        ] {
            let body = pkt(&format!("{A} {B} {name}\n")) + "0000";
            assert!(bad(body.as_bytes()), "{name}");
        }
        // Endless commands without a flush: bounded.
        let line = pkt(&format!("{A} {B} refs/heads/{}\n", "x".repeat(900)));
        let long = line.repeat(MAX_COMMAND_BYTES / line.len() + 2);
        assert!(bad(long.as_bytes()));
        // A pkt-line announcing more than the buffer holds, past the cap.
        let mut huge = b"fff0".to_vec();
        huge.resize(MAX_COMMAND_BYTES + 10, b'a');
        assert!(bad(&huge));
    }
}
