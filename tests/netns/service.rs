//! Service-aware rules under interception, through real clients: `git`
//! (clone, fetch, push) against `git http-backend` in the fake internet,
//! `pip download` from a simple index and refused uploads on a registry
//! rule, hand-built GraphQL and model-API requests with their evasions.
//! The upstream fixture (tests/fixtures/service_upstream.py) logs every
//! request it receives, with the Authorization it carried: the witness
//! that a refused request never reached it and that the injected
//! credential went only with allowed ones.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::lab::{
    ca_pem, certs_dir, fixtures_dir, read_jsonl, scratch_dir, Background, CmdOutput, HttpResp, Lab,
    ALLOWED_IP, PROXY_URL,
};

const PYTHON: &str = "/usr/bin/python3";
const SECRET: &str = "forge-tok-5e0c9a1d";
const GIT_PORT: u16 = 8443;
const REGISTRY_PORT: u16 = 8444;
const GRAPHQL_PORT: u16 = 8445;
const MODEL_PORT: u16 = 8446;

fn policy(secret: &Path) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "forge"
host = "allowed.test"
ports = [{GIT_PORT}]
intercept = true
service = "git"
repos = ["acme/app", "tools/*"]
push_refs = ["refs/heads/agent/*"]

[[org.allow]]
id = "registry"
host = "allowed.test"
ports = [{REGISTRY_PORT}]
intercept = true
service = "registry"

[[org.allow]]
id = "graphql"
host = "allowed.test"
ports = [{GRAPHQL_PORT}]
intercept = true
service = "graphql"
graphql_mutations = ["createPullRequest"]

[[org.allow]]
id = "model"
host = "allowed.test"
ports = [{MODEL_PORT}]
intercept = true
service = "llm-api"
models = ["claude-*"]

[[org.credential]]
id = "forge-token"
host = "allowed.test"
header = "Authorization"
prefix = "Bearer "
secret_file = {secret:?}
"#
    )
}

struct Setup {
    lab: Lab,
    org_ca: PathBuf,
    git_root: PathBuf,
    index_root: PathBuf,
    log: PathBuf,
    _server: Background,
}

fn must(out: CmdOutput, what: &str) -> CmdOutput {
    assert!(out.success(), "{what}: {}", out.describe());
    out
}

fn host_git(args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("HOME", "/nonexistent")
        .output()
        .expect("git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A bare repository at `root/path` with one commit on `main`.
fn bare_repo(root: &Path, path: &str) {
    let bare = root.join(path);
    let work = root.join(format!("{path}-work"));
    let (b, w) = (bare.display().to_string(), work.display().to_string());
    host_git(&["init", "-q", "--bare", "-b", "main", &b]);
    host_git(&["--git-dir", &b, "config", "http.receivepack", "true"]);
    host_git(&["init", "-q", "-b", "main", &w]);
    fs::write(work.join("README"), "hello\n").unwrap();
    let c = [
        "-C",
        &w,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "init",
    ];
    host_git(&["-C", &w, "add", "README"]);
    host_git(&c);
    host_git(&["-C", &w, "push", "-q", &b, "main"]);
}

/// A simple index (PEP 503) with one wheel, `demo-pkg` 1.0.
fn simple_index(root: &Path) {
    let script = r#"
import sys, zipfile, hashlib, base64, os
root = sys.argv[1]
os.makedirs(os.path.join(root, "simple", "demo-pkg"), exist_ok=True)
os.makedirs(os.path.join(root, "packages"), exist_ok=True)
name = "demo_pkg-1.0-py3-none-any.whl"
files = {
    "demo_pkg/__init__.py": b"VERSION = '1.0'\n",
    "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
    "demo_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for p, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{p},sha256={digest},{len(data)}\n"
record += "demo_pkg-1.0.dist-info/RECORD,,\n"
path = os.path.join(root, "packages", name)
with zipfile.ZipFile(path, "w") as z:
    for p, data in files.items():
        z.writestr(p, data)
    z.writestr("demo_pkg-1.0.dist-info/RECORD", record)
sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
with open(os.path.join(root, "simple", "demo-pkg", "index.html"), "w") as f:
    f.write(f'<html><body><a href="/packages/{name}#sha256={sha}">{name}</a></body></html>\n')
with open(os.path.join(root, "simple", "index.html"), "w") as f:
    f.write('<html><body><a href="/simple/demo-pkg/">demo-pkg</a></body></html>\n')
"#;
    let out = std::process::Command::new(PYTHON)
        .args(["-c", script])
        .arg(root)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

fn start() -> Setup {
    let dir = scratch_dir("service");
    let secret = dir.join("forge.token");
    fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let ca_dir = dir.join("ca");
    let git_root = dir.join("git");
    let index_root = dir.join("index");
    fs::create_dir_all(&git_root).unwrap();
    fs::create_dir_all(&index_root).unwrap();
    bare_repo(&git_root, "acme/app.git");
    bare_repo(&git_root, "acme/secret.git");
    simple_index(&index_root);
    let mut lab = Lab::builder()
        .policy(&policy(&secret))
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .without_proxy()
        .start();
    let log = lab.dir.join("service-upstream.log");
    fs::write(&log, "").unwrap();
    let certs = certs_dir();
    let mut args: Vec<String> = vec![
        fixtures_dir()
            .join("service_upstream.py")
            .display()
            .to_string(),
        "--addr".into(),
        ALLOWED_IP.into(),
        "--git-port".into(),
        GIT_PORT.to_string(),
    ];
    for p in [REGISTRY_PORT, GRAPHQL_PORT, MODEL_PORT] {
        args.extend(["--port".into(), p.to_string()]);
    }
    for (k, v) in [
        ("--cert", certs.join("server.pem")),
        ("--key", certs.join("server.key")),
        ("--git-root", git_root.clone()),
        ("--index-root", index_root.clone()),
        ("--log", log.clone()),
    ] {
        args.extend([k.to_string(), v.display().to_string()]);
    }
    let server = lab.spawn_upstream_server("the service upstream", PYTHON, &args);
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    let org_ca = ca_dir.join("acme.pem");
    assert!(org_ca.exists(), "the org CA was created");
    Setup {
        lab,
        org_ca,
        git_root,
        index_root,
        log,
        _server: server,
    }
}

impl Setup {
    /// What the upstream received, in order.
    fn received(&self) -> Vec<Value> {
        read_jsonl(&self.log)
    }

    /// git in the client namespace, through the proxy, trusting the org CA.
    fn git(&self, args: &[&str]) -> CmdOutput {
        let ca = format!("GIT_SSL_CAINFO={}", self.org_ca.display());
        let proxy = format!("https_proxy={PROXY_URL}");
        let mut full = vec![
            "HOME=/nonexistent",
            "GIT_CONFIG_NOSYSTEM=1",
            "GIT_TERMINAL_PROMPT=0",
            &ca,
            &proxy,
            "git",
        ];
        full.extend_from_slice(args);
        self.lab.client_exec("env", &full)
    }

    fn curl(&self, url: &str, extra: &[&str]) -> HttpResp {
        let ca = self.org_ca.display().to_string();
        let mut args: Vec<&str> = vec!["-x", PROXY_URL, "--cacert", &ca];
        args.extend_from_slice(extra);
        args.push(url);
        self.lab.client_curl(&args)
    }

    fn denied(&self, what: &str, detail: &str) -> Value {
        self.lab.wait_evidence(what, |v| {
            v["kind"] == "http"
                && v["reason"] == "service_denied"
                && v["detail"].as_str().is_some_and(|d| d.contains(detail))
        })
    }
}

fn refs_of(root: &Path, repo: &str) -> String {
    let dir = root.join(repo).display().to_string();
    host_git(&[
        "--git-dir",
        &dir,
        "for-each-ref",
        "--format=%(refname) %(objectname)",
    ])
}

#[test]
fn git_clone_fetch_and_push_are_scoped_to_repos_and_refs() {
    let s = start();
    let work = s.lab.dir.join("clone");
    let w = work.display().to_string();
    let app = format!("https://allowed.test:{GIT_PORT}/acme/app.git");

    // Clone and fetch of a listed repository work.
    must(s.git(&["clone", "-q", &app, &w]), "clone acme/app");
    assert!(work.join("README").exists());
    must(
        s.git(&["-C", &w, "fetch", "-q", "origin"]),
        "fetch acme/app",
    );
    // Without `.git` too.
    let bare_url = format!("https://allowed.test:{GIT_PORT}/acme/app");
    must(s.git(&["ls-remote", &bare_url]), "ls-remote acme/app");

    // An unlisted repository: refused, nothing reaches the server.
    let before = s.received().len();
    let secret_url = format!("https://allowed.test:{GIT_PORT}/acme/secret.git");
    let other = s.lab.dir.join("secret").display().to_string();
    let out = s.git(&["clone", "-q", &secret_url, &other]);
    assert!(
        !out.success(),
        "clone of an unlisted repo: {}",
        out.describe()
    );
    let rec = s.denied("clone of acme/secret", "fetch of acme/secret");
    assert_eq!(rec["service"]["repo"], "acme/secret", "{rec}");
    assert_eq!(s.received().len(), before, "{:?}", s.received());

    // A push to refs/heads/agent/x works.
    let c = [
        "-C",
        &w,
        "-c",
        "user.name=agent",
        "-c",
        "user.email=a@a",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "agent work",
    ];
    must(s.git(&c), "commit");
    must(
        s.git(&["-C", &w, "push", "-q", "origin", "HEAD:refs/heads/agent/x"]),
        "push to agent/x",
    );
    let refs = refs_of(&s.git_root, "acme/app.git");
    assert!(refs.contains("refs/heads/agent/x"), "{refs}");
    let ok = s.lab.wait_evidence("allowed push", |v| {
        v["kind"] == "http" && v["decision"] == "allow" && v["service"]["operation"] == "push"
    });
    assert_eq!(
        ok["service"]["refs"][0], "create refs/heads/agent/x",
        "{ok}"
    );
    assert_eq!(ok["credential"], "forge-token", "{ok}");

    // A push to main fails; the server's refs are unchanged, and the
    // receive-pack POST never reached it.
    let before_refs = refs_of(&s.git_root, "acme/app.git");
    let before = s.received().len();
    let out = s.git(&["-C", &w, "push", "-q", "origin", "HEAD:refs/heads/main"]);
    assert!(!out.success(), "push to main: {}", out.describe());
    let rec = s.denied("push to main", "git push to refs/heads/main");
    assert_eq!(rec["service"]["repo"], "acme/app", "{rec}");
    assert_eq!(rec["rule"], "forge", "{rec}");
    assert!(rec.get("credential").is_none(), "{rec}");
    assert_eq!(refs_of(&s.git_root, "acme/app.git"), before_refs);
    let posted: Vec<Value> = s.received()[before..]
        .iter()
        .filter(|r| r["method"] == "POST")
        .cloned()
        .collect();
    assert!(
        posted.is_empty(),
        "receive-pack reached the server: {posted:?}"
    );
    // Two refs at once, one outside push_refs: refused whole.
    let out = s.git(&[
        "-C",
        &w,
        "push",
        "-q",
        "origin",
        "HEAD:refs/heads/agent/y",
        "HEAD:refs/tags/v1",
    ]);
    assert!(!out.success(), "{}", out.describe());
    s.denied("push with a tag", "git push to refs/tags/v1");
    assert_eq!(refs_of(&s.git_root, "acme/app.git"), before_refs);
    // Deleting main is a push to main too.
    let out = s.git(&["-C", &w, "push", "-q", "origin", ":refs/heads/main"]);
    assert!(!out.success(), "{}", out.describe());
    s.denied("delete of main", "git push to refs/heads/main (delete)");
    assert_eq!(refs_of(&s.git_root, "acme/app.git"), before_refs);

    // The credential reached the server on every request it received,
    // and only there; refused requests never arrived.
    let all = s.received();
    assert!(!all.is_empty());
    for r in &all {
        assert_eq!(r["authorization"], format!("Bearer {SECRET}"), "{r}");
        assert!(
            !r["path"].as_str().unwrap_or("").contains("acme/secret"),
            "{r}"
        );
    }
    // No record carries the secret.
    let evidence = s.lab.evidence();
    assert!(!serde_json::to_string(&evidence).unwrap().contains(SECRET));
}

#[test]
fn registry_downloads_work_and_publishing_is_refused() {
    let s = start();
    let dl = s.lab.dir.join("dl");
    let (dl_s, ca) = (dl.display().to_string(), s.org_ca.display().to_string());
    let index = format!("https://allowed.test:{REGISTRY_PORT}/simple/");
    let out = s.lab.client_exec(
        "env",
        &[
            // pip reads its trust from the environment first: start clean.
            "-i",
            "PATH=/usr/bin:/bin",
            "HOME=/nonexistent",
            "PIP_CONFIG_FILE=/dev/null",
            "python3",
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--proxy",
            PROXY_URL,
            "--cert",
            &ca,
            "--index-url",
            &index,
            "-d",
            &dl_s,
            "demo-pkg",
        ],
    );
    assert!(out.success(), "pip download: {}", out.describe());
    assert!(dl.join("demo_pkg-1.0-py3-none-any.whl").exists());
    assert!(s.index_root.join("packages").exists());

    let before = s.received().len();
    let base = format!("https://allowed.test:{REGISTRY_PORT}");
    // A PyPI-style upload (twine's multipart POST to /legacy/).
    let whl = s
        .index_root
        .join("packages/demo_pkg-1.0-py3-none-any.whl")
        .display()
        .to_string();
    let up = s.curl(
        &format!("{base}/legacy/"),
        &[
            "-F",
            ":action=file_upload",
            "-F",
            "name=demo-pkg",
            "-F",
            &format!("content=@{whl}"),
        ],
    );
    assert_eq!(up.status, 403, "{up:#?}");
    assert!(up.body.contains("registry publish"), "{up:#?}");
    s.denied("pypi upload", "registry publish (POST /legacy/)");
    // npm publish: PUT of the package document.
    let npm = s.curl(
        &format!("{base}/demo-pkg"),
        &[
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/json",
            "--data",
            r#"{"name":"demo-pkg","versions":{},"_attachments":{}}"#,
        ],
    );
    assert_eq!(npm.status, 403, "{npm:#?}");
    s.denied("npm publish", "registry publish (PUT /demo-pkg)");
    let unpub = s.curl(&format!("{base}/demo-pkg/-rev/1-abc"), &["-X", "DELETE"]);
    assert_eq!(unpub.status, 403, "{unpub:#?}");
    s.denied("npm unpublish", "registry unpublish");
    let crate_new = s.curl(
        &format!("{base}/api/v1/crates/new"),
        &["-X", "PUT", "--data-binary", "x"],
    );
    assert_eq!(crate_new.status, 403, "{crate_new:#?}");
    assert_eq!(s.received().len(), before, "{:?}", &s.received()[before..]);
}

#[test]
fn graphql_operations_and_model_calls_are_checked_with_their_evasions() {
    let s = start();
    let gql = format!("https://allowed.test:{GRAPHQL_PORT}/graphql");
    let post = |body: &str| {
        s.curl(
            &gql,
            &[
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                body,
            ],
        )
    };
    let allowed = [
        r#"{"query":"{ viewer { login } }"}"#,
        r#"{"query":"query Q { a } mutation M { deleteRepository(input: {}) { id } }","operationName":"Q"}"#,
        r#"{"query":"mutation { createPullRequest(input: {}) { id } }"}"#,
        r#"[{"query":"{ a }"},{"query":"mutation { createPullRequest { id } }"}]"#,
        r##"{"query":"# mutation { deleteRepository }\n{ a(s: \"mutation { deleteRepository }\") }"}"##,
    ];
    for body in allowed {
        let r = post(body);
        assert_eq!(r.status, 200, "{body}: {r:#?}");
    }
    let before = s.received().len();
    let refused = [
        (
            r#"{"query":"mutation { deleteRepository(input: {}) { id } }"}"#,
            "graphql mutation deleteRepository",
        ),
        // An alias named like an allowed mutation.
        (
            r#"{"query":"mutation { createPullRequest: deleteRepository(input: {}) { id } }"}"#,
            "graphql mutation deleteRepository",
        ),
        // Hidden in a fragment.
        (
            r#"{"query":"mutation { ...F } fragment F on Mutation { deleteRepository { id } }"}"#,
            "graphql mutation deleteRepository",
        ),
        // Two operations, no operationName.
        (
            r#"{"query":"query Q { a } mutation M { deleteRepository { id } }"}"#,
            "ambiguous",
        ),
        // A batch with one bad element.
        (
            r#"[{"query":"{ a }"},{"query":"mutation { deleteRepository { id } }"}]"#,
            "graphql mutation deleteRepository",
        ),
        // A repeated key.
        (
            r#"{"query":"{ a }","query":"mutation { deleteRepository { id } }"}"#,
            "duplicate field",
        ),
        (r#"{"query":"subscription { x }"}"#, "graphql subscription"),
        (
            r#"{"extensions":{"persistedQuery":{"sha256Hash":"ab"}}}"#,
            "persisted",
        ),
    ];
    for (body, detail) in refused {
        let r = post(body);
        assert_eq!(r.status, 403, "{body}: {r:#?}");
        s.denied(body, detail);
    }
    // GET ?query= is read the same way.
    let get = s.curl(&format!("{gql}?query=%7Ba%7D"), &[]);
    assert_eq!(get.status, 200, "{get:#?}");
    let get = s.curl(
        &format!("{gql}?query=mutation%7BdeleteRepository%7Bid%7D%7D"),
        &[],
    );
    assert_eq!(get.status, 403, "{get:#?}");
    // Another content type: not read, refused.
    let form = s.curl(
        &gql,
        &[
            "-H",
            "Content-Type: application/graphql",
            "--data-binary",
            "mutation { deleteRepository }",
        ],
    );
    assert_eq!(form.status, 403, "{form:#?}");
    let rec = s.denied("mutation record", "graphql mutation deleteRepository");
    assert_eq!(rec["service"]["name"], "graphql", "{rec}");
    assert!(
        rec["service"]["operation"]
            .as_str()
            .is_some_and(|o| o.contains("mutation deleteRepository")),
        "{rec}"
    );
    assert_eq!(s.received().len() - before, 1, "only the GET query arrived");

    // Model API.
    let model = |path: &str, body: &str| {
        s.curl(
            &format!("https://allowed.test:{MODEL_PORT}{path}"),
            &[
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                body,
            ],
        )
    };
    let ok = model(
        "/v1/messages",
        r#"{"model":"claude-sonnet-4","stream":true}"#,
    );
    assert_eq!(ok.status, 200, "{ok:#?}");
    let before = s.received().len();
    for (path, body, detail) in [
        ("/v1/messages", r#"{"model":"gpt-x"}"#, "model gpt-x"),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#,
            "model missing",
        ),
        (
            "/v1/messages",
            r#"{"model":"claude-x","model":"gpt-x"}"#,
            "duplicate field",
        ),
        (
            "/v1/messages",
            r#"{"model":"claude-x","mod\u0065l":"gpt-x"}"#,
            "duplicate field",
        ),
        (
            "/v1/files",
            r#"{"model":"claude-x"}"#,
            "not a recognised model endpoint",
        ),
        (
            "/v1beta/models/gemini-pro:generateContent",
            "{}",
            "model gemini-pro",
        ),
    ] {
        let r = model(path, body);
        assert_eq!(r.status, 403, "{path} {body}: {r:#?}");
        s.denied(body, detail);
    }
    assert_eq!(s.received().len(), before, "{:?}", &s.received()[before..]);
    let rec = s.denied("model record", "model gpt-x");
    assert_eq!(rec["service"]["model"], "gpt-x", "{rec}");
}
