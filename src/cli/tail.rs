//! `palisade tail [--admin ADDR] [--token-file F] [filters] [--json]`: the
//! live decision tail of a running instance (`GET /v1/decisions` on its
//! admin listener), one aligned line per decision, coloured when stdout is
//! a terminal, or the records as JSON Lines with `--json`. The filters go
//! to the instance as they are given: it parses them into the one record
//! [`Selection`](crate::evidence::select::Selection), with the parsers of
//! `evidence query`, and answers 400 naming one it cannot use (exit 2,
//! one line).

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;

use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use super::{CliError, Status};

/// Arguments of `palisade tail`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The instance's admin listener.
    #[arg(long, default_value = "127.0.0.1:9711", value_name = "ADDR")]
    pub admin: SocketAddr,
    /// A file holding the bearer token (its SHA-256 is in `[admin]
    /// tail_tokens`).
    #[arg(long, value_name = "F")]
    pub token_file: Option<PathBuf>,
    /// Org name (`unknown` for clients of no org).
    #[arg(long)]
    pub org: Option<String>,
    /// allow or deny.
    #[arg(long)]
    pub decision: Option<String>,
    /// Reason code, e.g. no_matching_rule.
    #[arg(long)]
    pub reason: Option<String>,
    /// Target host glob: a name, or '*.example.com' for the names below it
    /// (`*` any run of characters, `?` one), as `evidence query --host`.
    #[arg(long)]
    pub host: Option<String>,
    /// tcp, http, dns or bypass.
    #[arg(long)]
    pub kind: Option<String>,
    /// explicit, transparent, dns or socks5.
    #[arg(long)]
    pub mode: Option<String>,
    /// The records as JSON Lines, as the server sends them.
    #[arg(long)]
    pub json: bool,
}

impl Args {
    fn query(&self) -> String {
        let mut q = form_urlencoded::Serializer::new(String::new());
        for (k, v) in [
            ("org", &self.org),
            ("decision", &self.decision),
            ("reason", &self.reason),
            ("host", &self.host),
            ("kind", &self.kind),
            ("mode", &self.mode),
        ] {
            if let Some(v) = v {
                q.append_pair(k, v);
            }
        }
        q.finish()
    }
}

/// Stream until the server ends the tail (0), or fail: 1 when the admin
/// listener cannot be reached or refuses (401, 503), 2 on a filter it
/// does not accept (400) or an unreadable token file.
pub fn run(args: Args) -> Result<(), CliError> {
    let token = match &args.token_file {
        Some(f) => {
            let t = std::fs::read_to_string(f).map_err(|e| {
                CliError::new(Status::BadInput, format_args!("{}: {e}", f.display()))
            })?;
            Some(t.trim().to_string())
        }
        None => None,
    };
    super::runtime()?.block_on(tail(&args, token))
}

async fn tail(args: &Args, token: Option<String>) -> Result<(), CliError> {
    let failed = |m: String| CliError::new(Status::Failed, m);
    let stream = tokio::net::TcpStream::connect(args.admin)
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", args.admin)))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", args.admin)))?;
    tokio::spawn(conn);
    let query = args.query();
    let uri = if query.is_empty() {
        "/v1/decisions".to_string()
    } else {
        format!("/v1/decisions?{query}")
    };
    let mut req = http::Request::get(uri).header(http::header::HOST, args.admin.to_string());
    if let Some(t) = &token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = req
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| failed(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", args.admin)))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if status != http::StatusCode::OK {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).trim().to_string())
            .unwrap_or_default();
        let code = if status == http::StatusCode::BAD_REQUEST {
            Status::BadInput
        } else {
            Status::Failed
        };
        return Err(CliError::new(
            code,
            format_args!("tail refused ({}): {text}", status.as_u16()),
        ));
    }
    eprintln!("palisade: tailing decisions on {}", args.admin);
    let colour = !args.json && std::io::stdout().is_terminal();
    if !args.json {
        sayln!("{}", header());
    }
    let mut pending: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| failed(format!("the tail broke off: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = &line[..line.len() - 1];
            if args.json {
                sayln!("{}", String::from_utf8_lossy(line));
            } else if let Ok(v) = serde_json::from_slice::<Value>(line) {
                sayln!("{}", render(&v, colour));
            }
            // The reader has gone (`palisade tail | head`): done, quietly.
            if super::stdout_gone() {
                return Ok(());
            }
        }
        // A line longer than any record: the server is not Palisade.
        if pending.len() > 1 << 20 {
            return Err(failed("the tail sent a line over 1 MiB".into()));
        }
    }
    eprintln!("palisade: the tail ended (the instance closed it)");
    Ok(())
}

const WIDTHS: [usize; 8] = [23, 10, 21, 11, 32, 10, 18, 20];

fn header() -> String {
    line(&[
        "TIME", "ORG", "CLIENT", "MODE", "TARGET", "DECISION", "REASON", "RULE", "REF",
    ])
}

fn line(cells: &[&str; 9]) -> String {
    let mut s = String::new();
    for (i, c) in cells.iter().enumerate() {
        match WIDTHS.get(i) {
            Some(w) => s.push_str(&format!("{c:<w$} ")),
            None => s.push_str(c),
        }
    }
    s.trim_end().to_string()
}

/// One decision as an aligned line (a gap as a line saying so).
pub(crate) fn render(v: &Value, colour: bool) -> String {
    if let Some(n) = v.get("gap").and_then(Value::as_u64) {
        return format!("-- {n} records not shown: this tail fell behind --");
    }
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("-").to_string();
    let ts = s("ts");
    let ts = ts.get(..23).unwrap_or(&ts).to_string();
    let target = match (v.get("host").and_then(Value::as_str), v.get("port")) {
        (Some(h), Some(Value::Number(p))) if h.contains(':') => format!("[{h}]:{p}"),
        (Some(h), Some(Value::Number(p))) => format!("{h}:{p}"),
        (Some(h), _) => h.to_string(),
        (None, _) => match v.get("count").and_then(Value::as_u64) {
            Some(n) => format!("({n} summarised)"),
            None => "-".into(),
        },
    };
    let would = v.get("would_deny").and_then(Value::as_str);
    let decision = match would {
        Some(_) => "would_deny".to_string(),
        None => s("decision"),
    };
    let reason = would.map_or_else(|| s("reason"), str::to_string);
    let reference = v
        .get("ref")
        .or_else(|| v.get("id"))
        .and_then(Value::as_str)
        .unwrap_or("-")
        .to_string();
    let text = line(&[
        &ts,
        &s("org"),
        &s("client"),
        &s("mode"),
        &target,
        &decision,
        &reason,
        &s("rule"),
        &reference,
    ]);
    if !colour {
        return text;
    }
    let code = match (decision.as_str(), would) {
        (_, Some(_)) => "33",
        ("deny", _) => "31",
        _ => "32",
    };
    format!("\x1b[{code}m{text}\x1b[0m")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_renders_as_one_aligned_line_coloured_only_on_request() {
        let v: Value = serde_json::from_str(
            r#"{"ts":"2026-01-02T03:04:05.123456Z","org":"acme","client":"198.18.1.2:4000","mode":"explicit","host":"other.test","port":80,"decision":"deny","reason":"no_matching_rule","rule":null,"ref":"be1d68c532995004","id":"x"}"#,
        )
        .unwrap();
        let plain = render(&v, false);
        assert!(
            plain.starts_with("2026-01-02T03:04:05.123 acme       198.18.1.2:4000"),
            "{plain}"
        );
        assert!(plain.contains(" other.test:80 "), "{plain}");
        assert!(plain.ends_with("be1d68c532995004"), "{plain}");
        assert_eq!(
            plain.find("other.test"),
            header().find("TARGET"),
            "columns align:\n{}\n{plain}",
            header()
        );
        assert!(render(&v, true).starts_with("\x1b[31m"));
        let report: Value = serde_json::from_str(
            r#"{"ts":"t","host":"x.test","port":443,"decision":"allow","reason":"report_only","would_deny":"no_matching_rule"}"#,
        )
        .unwrap();
        let r = render(&report, false);
        assert!(r.contains("would_deny no_matching_rule"), "{r}");
        let gap: Value = serde_json::from_str(r#"{"gap": 7}"#).unwrap();
        assert!(render(&gap, false).contains("7 records not shown"));
        let v6: Value = serde_json::from_str(r#"{"host":"2001:2::1","port":443}"#).unwrap();
        assert!(render(&v6, false).contains("[2001:2::1]:443"));
    }

    #[test]
    fn filters_become_the_query() {
        let args = Args {
            admin: "127.0.0.1:9711".parse().unwrap(),
            token_file: None,
            org: Some("acme".into()),
            decision: Some("deny".into()),
            reason: None,
            host: Some("*.example.com".into()),
            kind: None,
            mode: None,
            json: false,
        };
        assert_eq!(args.query(), "org=acme&decision=deny&host=*.example.com");
    }
}
