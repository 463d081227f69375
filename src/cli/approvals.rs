//! `palisade approvals`, `palisade grant`, `palisade grants`: the
//! approvers' API of a running instance (`/v1/approvals`, `/v1/grants` on
//! its admin listener, [`crate::admin::approvals`]) from the command line,
//! with a token of `[admin] approver_tokens` read from `--token-file` or
//! `PALISADE_APPROVER_TOKEN`. Exit 0 when done, 1 when the instance cannot
//! be reached or refuses (401, 404, 409), 2 on input it rejects (400).

use std::net::SocketAddr;
use std::path::PathBuf;

use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

use super::{CliError, Status};

/// Where the instance is and who asks.
#[derive(clap::Args, Debug)]
pub struct Admin {
    /// The instance's admin listener.
    #[arg(
        long,
        default_value = "127.0.0.1:9711",
        value_name = "ADDR",
        global = true
    )]
    pub admin: SocketAddr,
    /// A file holding the approver's bearer token (its SHA-256 is in
    /// `[admin] approver_tokens`); else `PALISADE_APPROVER_TOKEN`.
    #[arg(long, value_name = "F", global = true)]
    pub token_file: Option<PathBuf>,
}

/// Arguments of `palisade approvals`.
#[derive(clap::Args, Debug)]
pub struct ApprovalsArgs {
    #[command(flatten)]
    pub admin: Admin,
    #[command(subcommand)]
    pub command: Option<ApprovalsCommand>,
}

/// `palisade approvals answer`.
#[derive(clap::Subcommand, Debug)]
pub enum ApprovalsCommand {
    /// Answer one pending approval.
    Answer {
        /// The approval's id (`a-…`).
        id: String,
        /// Allow it: a grant of exactly what it asked.
        #[arg(long, conflicts_with = "deny", required_unless_present = "deny")]
        allow: bool,
        /// Deny it.
        #[arg(long)]
        deny: bool,
        /// How long the grant lasts (e.g. 10m, 1h; at most 24h).
        #[arg(long)]
        ttl: Option<String>,
        /// How many connections it allows.
        #[arg(long)]
        max_uses: Option<u32>,
        /// Why, for the record.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// Arguments of `palisade grant`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GrantArgs {
    #[command(flatten)]
    pub admin: Admin,
    #[command(subcommand)]
    pub command: Option<GrantCommand>,
    /// The org the grant is for.
    #[arg(long)]
    pub org: Option<String>,
    /// HOST:PORT, ADDRESS:PORT, `[V6]:PORT` or CIDR:PORT.
    pub target: Option<String>,
    /// How long it lasts (e.g. 10m, 1h; at most 24h; with neither this nor
    /// --max-uses, 1h).
    #[arg(long)]
    pub ttl: Option<String>,
    /// How many connections it allows.
    #[arg(long)]
    pub max_uses: Option<u32>,
    /// Why, for the record.
    #[arg(long)]
    pub reason: Option<String>,
    /// Requests only, with this method (plain `http://` requests, whose
    /// method Palisade sees; a tunnel is not covered).
    #[arg(long)]
    pub method: Option<String>,
    /// Requests only, whose path this pattern matches (a prefix, or a glob
    /// where `*` matches anything; as an allow rule's `paths`).
    #[arg(long)]
    pub path: Option<String>,
}

/// `palisade grant revoke`.
#[derive(clap::Subcommand, Debug)]
pub enum GrantCommand {
    /// End a grant now: its live connections are closed.
    Revoke {
        /// The grant's id (`g-…`).
        id: String,
    },
}

fn token(admin: &Admin) -> Result<String, CliError> {
    let text = match &admin.token_file {
        Some(f) => std::fs::read_to_string(f)
            .map_err(|e| CliError::new(Status::BadInput, format_args!("{}: {e}", f.display())))?,
        None => std::env::var("PALISADE_APPROVER_TOKEN").map_err(|_| {
            CliError::new(
                Status::BadInput,
                "no approver token: --token-file F, or PALISADE_APPROVER_TOKEN",
            )
        })?,
    };
    Ok(text.trim().to_string())
}

/// One request to the admin listener: the JSON it answered, or the error
/// by status.
async fn call(
    admin: &Admin,
    method: http::Method,
    path: &str,
    body: Option<Value>,
) -> Result<Value, CliError> {
    let token = token(admin)?;
    let failed = |m: String| CliError::new(Status::Failed, m);
    let stream = tokio::net::TcpStream::connect(admin.admin)
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", admin.admin)))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", admin.admin)))?;
    tokio::spawn(conn);
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, admin.admin.to_string())
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes::Bytes::from(bytes)))
        .map_err(|e| failed(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| failed(format!("admin listener {}: {e}", admin.admin)))?;
    let status = resp.status();
    let text = resp
        .into_body()
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).trim().to_string())
        .unwrap_or_default();
    if status.is_success() {
        return serde_json::from_str(&text).map_err(|e| failed(format!("not JSON ({e}): {text}")));
    }
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or(text);
    let code = if status == http::StatusCode::BAD_REQUEST {
        Status::BadInput
    } else {
        Status::Failed
    };
    Err(CliError::new(
        code,
        format_args!("{} ({}): {message}", path, status.as_u16()),
    ))
}

fn s(v: &Value, k: &str) -> String {
    match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn print_grant(g: &Value) -> Result<(), CliError> {
    let requests = match (&g["method"], &g["path"]) {
        (Value::Null, Value::Null) => String::new(),
        _ => format!(" {} {}", s(g, "method"), s(g, "path")),
    };
    sayln!(
        "{}\t{}\t{}:{}{requests}\tends {}\tuses {}/{}\tby {}",
        s(g, "id"),
        s(g, "org"),
        s(g, "target"),
        s(g, "port"),
        s(g, "expires"),
        s(g, "uses"),
        s(g, "max_uses"),
        s(g, "approver")
    );
    Ok(())
}

/// `palisade approvals [answer …]`.
pub fn approvals(args: ApprovalsArgs) -> Result<(), CliError> {
    super::runtime()?.block_on(async move {
        match args.command {
            None => {
                let v = call(&args.admin, http::Method::GET, "/v1/approvals", None).await?;
                let list = v["approvals"].as_array().cloned().unwrap_or_default();
                if list.is_empty() {
                    sayln!("no pending approvals");
                }
                for a in &list {
                    sayln!(
                        "{}\t{}\t{}\tclient {}\tfirst {}\tlast {}\tcount {}",
                        s(a, "id"),
                        s(a, "org"),
                        s(a, "destination"),
                        s(a, "last_client"),
                        s(a, "first_seen"),
                        s(a, "last_seen"),
                        s(a, "count")
                    );
                }
                Ok(())
            }
            Some(ApprovalsCommand::Answer {
                id,
                allow,
                deny: _,
                ttl,
                max_uses,
                reason,
            }) => {
                let body = json!({
                    "decision": if allow { "allow" } else { "deny" },
                    "ttl": ttl, "max_uses": max_uses, "reason": reason,
                });
                let path = format!("/v1/approvals/{id}");
                let v = call(&args.admin, http::Method::POST, &path, Some(body)).await?;
                match v.get("grant") {
                    Some(g) => print_grant(g)?,
                    None => sayln!("{id} denied"),
                }
                Ok(())
            }
        }
    })
}

/// `palisade grant --org O TARGET …` and `palisade grant revoke ID`.
pub fn grant(args: GrantArgs) -> Result<(), CliError> {
    let bad = |m: String| CliError::new(Status::BadInput, m);
    let request = match &args.command {
        Some(GrantCommand::Revoke { id }) => {
            (http::Method::DELETE, format!("/v1/grants/{id}"), None)
        }
        None => {
            let (Some(org), Some(target)) = (&args.org, &args.target) else {
                return Err(bad(
                    "grant needs --org ORG and a TARGET (HOST:PORT), or `revoke ID`".into(),
                ));
            };
            let (host, port) = split_target(target).map_err(bad)?;
            let body = json!({
                "org": org, "target": host, "port": port,
                "ttl": args.ttl, "max_uses": args.max_uses, "reason": args.reason,
                "method": args.method, "path": args.path,
            });
            (http::Method::POST, "/v1/grants".to_string(), Some(body))
        }
    };
    super::runtime()?.block_on(async move {
        let v = call(&args.admin, request.0, &request.1, request.2).await?;
        print_grant(v.get("revoked").unwrap_or(&v))
    })
}

/// `palisade grants`.
pub fn grants(admin: Admin) -> Result<(), CliError> {
    super::runtime()?.block_on(async move {
        let v = call(&admin, http::Method::GET, "/v1/grants", None).await?;
        let list = v["grants"].as_array().cloned().unwrap_or_default();
        if list.is_empty() {
            sayln!("no grants");
        }
        for g in &list {
            print_grant(g)?;
        }
        Ok(())
    })
}

/// `HOST:PORT` (a name, an address, `[v6]`, or a CIDR) into its parts.
fn split_target(text: &str) -> Result<(String, u16), String> {
    let (host, port) = text
        .rsplit_once(':')
        .ok_or_else(|| format!("target {text:?}: expected HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("target {text:?}: port {port:?} is not 1-65535"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("target {text:?}: no host"));
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_split_into_host_and_port() {
        assert_eq!(split_target("x.test:443").unwrap(), ("x.test".into(), 443));
        assert_eq!(
            split_target("[2001:2::1]:80").unwrap(),
            ("2001:2::1".into(), 80)
        );
        assert_eq!(
            split_target("198.18.7.0/24:443").unwrap(),
            ("198.18.7.0/24".into(), 443)
        );
        assert!(split_target("x.test").is_err());
        assert!(split_target("x.test:0").is_err());
    }
}
