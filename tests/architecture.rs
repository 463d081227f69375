//! The crate's shape, read from its source with `syn` as rustc parses it,
//! and held as rules (see "The architecture test" in
//! `docs/architecture.md`):
//!
//! - no cycle among the files of any folder (or the top-level modules),
//!   counting every path a file names (resolved through `use`, `pub use`
//!   re-exports and globs to the file that defines the item) and every
//!   method it calls on a type it can reach (to the file of the `impl`
//!   block that defines the method, wherever that block is); a folder's
//!   own `mod.rs` is a node of its graph like its children;
//! - inside `proxy/`, the files name each other down its layers, and only
//!   the modules above it name anything of `proxy/`;
//! - the pure parts (`PURE`) read no clock, use no tokio and do no I/O.
//! - no production function is longer than `MAX_FN_LINES` (an explicit,
//!   shrinking `LONG_FNS_ALLOWED` list aside).
//!
//! `#[cfg(test)]` items and files are left out: tests may do anything.
//! Every rule has a test below that feeds it a small made-up crate
//! breaking it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use syn::visit::Visit;

/// The files of `proxy/`, from the modes down: the trip of one connection
/// reads top to bottom. A file naming one in a layer above it runs back
/// up; names on one line are one layer.
const PROXY_LAYERS: &[&[&str]] = &[
    &["explicit", "socks5", "transparent"],
    &["listen"],
    &["connect"],
    &["intercepted"],
    &["forward", "revoke"],
    &["record", "admission"],
    &["failure", "conn"],
    &["decide", "dial"],
    &["ctx"],
    &["pool", "denials"],
    &["verify"],
    &["tunnel"],
    &["splice"],
    &["http"],
];

/// The top-level modules that may name anything of `proxy/`: the wiring
/// above it. Every other module is a layer below it.
const ABOVE_PROXY: &[&str] = &["analysis", "app", "cli", "testing"];

/// The pure parts: parsers and decisions over values, `now` passed in.
/// A folder ends with `/`.
const PURE: &[&str] = &[
    "proto/",
    "policy/",
    "handout/",
    "dns/decide.rs",
    "bypass/packet.rs",
    "enforcement/compare.rs",
    "evidence/merkle.rs",
    "evidence/note.rs",
    "evidence/retention.rs",
    "limits/table.rs",
    "jit/approvals.rs",
    "jit/grants.rs",
];

/// What a pure part may not name (paths, by prefix) ...
const IMPURE_PATHS: &[&str] = &[
    "tokio",
    "std::time::Instant::now",
    "std::time::SystemTime::now",
    "std::fs",
    "std::net::TcpStream",
    "std::net::TcpListener",
    "std::net::UdpSocket",
    "std::io::stdin",
    "std::io::stdout",
    "std::io::stderr",
    "std::process",
    "std::thread",
    "std::env",
];

/// ... nor call as a method (a clock read on an `Instant` or `SystemTime`).
const IMPURE_METHODS: &[&str] = &["elapsed"];

/// The most lines a production function may span, from `fn` to its
/// closing brace: a longer one is split into named steps.
const MAX_FN_LINES: usize = 120;

/// Functions that may be longer, for now: (file under `src/`, `name` or
/// `Type::name`, why). An entry no long function stands for any more
/// fails (delete it).
const LONG_FNS_ALLOWED: &[(&str, &str, &str)] = &[];

// ---------------------------------------------------------------------
// Reading the crate

/// A module path: `["proxy", "conn"]`; the crate root is `[]`.
type Mod = Vec<String>;

/// What a path names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Res {
    /// A module of the crate.
    Module(Mod),
    /// An item `name` defined in module `at`; `rest` are the segments
    /// after it (an associated item: `Policy::decide`).
    Item {
        at: Mod,
        name: String,
        rest: Vec<String>,
    },
    /// Outside the crate, as an absolute path (`std::time::Instant::now`).
    External(Vec<String>),
}

/// What a name in a module's scope stands for.
#[derive(Debug, Clone)]
enum Binding {
    Module(Mod),
    Item,
    /// `use` of this path, written in the module.
    Import(Vec<String>),
}

/// One `impl` block: where it is written, for which type, its methods and
/// the paths its methods' return types name.
#[derive(Debug, Default)]
struct Impl {
    written_in: Mod,
    self_ty: Vec<String>,
    /// The trait, for `impl Trait for Type`.
    trait_: Option<Vec<String>>,
    methods: Vec<String>,
    returns: Vec<Vec<String>>,
}

#[derive(Debug, Default)]
struct Facts {
    /// Names in each module's scope (a name may be a type and a value).
    scope: BTreeMap<Mod, BTreeMap<String, Vec<Binding>>>,
    globs: BTreeMap<Mod, Vec<Vec<String>>>,
    /// The file each module is written in (inline modules: their file's).
    file_of: BTreeMap<Mod, Mod>,
    /// Paths each file names: (module written in, path).
    refs: BTreeMap<Mod, Vec<(Mod, Vec<String>)>>,
    /// Methods each file calls.
    calls: BTreeMap<Mod, BTreeSet<String>>,
    /// Paths named by the fields of each type: (module, type name).
    fields: BTreeMap<(Mod, String), Vec<Vec<String>>>,
    impls: Vec<Impl>,
}

/// The module path of a file under `src/` (`proxy/conn.rs`: `proxy::conn`;
/// `proxy/http/mod.rs`: `proxy::http`; `lib.rs`: the crate root).
fn module_of(rel: &Path) -> Mod {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && !(parts.is_empty() && stem == "lib") {
        parts.push(stem.to_string());
    }
    parts
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.parse_args::<syn::Ident>().is_ok_and(|i| i == "test")
    })
}

fn segments(path: &syn::Path) -> Vec<String> {
    path.segments.iter().map(|s| s.ident.to_string()).collect()
}

/// Every path named inside a piece of syntax (a field's type, a return
/// type), `Self` replaced by `self_ty`.
#[derive(Default)]
struct Paths {
    self_ty: Vec<String>,
    found: Vec<Vec<String>>,
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs = segments(p);
        self.found.push(replace_self(&segs, &self.self_ty));
        syn::visit::visit_path(self, p);
    }
}

fn replace_self(segs: &[String], self_ty: &[String]) -> Vec<String> {
    match segs.first() {
        Some(s) if s == "Self" && !self_ty.is_empty() => {
            self_ty.iter().chain(&segs[1..]).cloned().collect()
        }
        _ => segs.to_vec(),
    }
}

/// Walks one file, recording into [`Facts`].
struct Collector<'f> {
    facts: &'f mut Facts,
    file: Mod,
    module: Mod,
    /// Inside an `impl`: its self type, for `Self`.
    self_ty: Vec<String>,
    /// Child modules declared with `#[cfg(test)]`: not read.
    test_children: &'f mut BTreeSet<Mod>,
}

impl Collector<'_> {
    fn bind(&mut self, name: String, b: Binding) {
        self.facts
            .scope
            .entry(self.module.clone())
            .or_default()
            .entry(name)
            .or_default()
            .push(b);
    }

    fn named(&mut self, path: Vec<String>) {
        if path.is_empty() {
            return;
        }
        let path = replace_self(&path, &self.self_ty);
        self.facts
            .refs
            .entry(self.file.clone())
            .or_default()
            .push((self.module.clone(), path));
    }

    fn called(&mut self, method: String) {
        self.facts
            .calls
            .entry(self.file.clone())
            .or_default()
            .insert(method);
    }

    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &[String]) {
        let mut path = prefix.to_vec();
        match tree {
            syn::UseTree::Path(p) => {
                path.push(p.ident.to_string());
                self.use_tree(&p.tree, &path);
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.to_string();
                if name == "self" {
                    if let Some(last) = path.last().cloned() {
                        self.bind(last, Binding::Import(path.clone()));
                    }
                } else {
                    path.push(name.clone());
                    self.bind(name, Binding::Import(path.clone()));
                }
                self.named(path);
            }
            syn::UseTree::Rename(r) => {
                let name = r.ident.to_string();
                if name != "self" {
                    path.push(name);
                }
                let alias = r.rename.to_string();
                if alias != "_" {
                    self.bind(alias, Binding::Import(path.clone()));
                }
                self.named(path);
            }
            syn::UseTree::Glob(_) => {
                self.facts
                    .globs
                    .entry(self.module.clone())
                    .or_default()
                    .push(path.clone());
                self.named(path);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(t, &path);
                }
            }
        }
    }

    /// A macro's tokens: parsed as expressions where they are (`format!`,
    /// `assert!`, `vec!`), else scanned for `a::b` paths and `.method(`.
    fn macro_tokens(&mut self, tokens: &proc_macro2::TokenStream) {
        type Args = syn::punctuated::Punctuated<syn::Expr, syn::Token![,]>;
        let parser = Args::parse_terminated;
        if let Ok(args) = syn::parse::Parser::parse2(parser, tokens.clone()) {
            for e in &args {
                self.visit_expr(e);
            }
            return;
        }
        let flat = flatten(tokens.clone());
        let mut i = 0;
        while i < flat.len() {
            if let Tok::Ident(first) = &flat[i] {
                let after_path = i > 0 && flat[i - 1] == Tok::Colons;
                let after_dot = i > 0 && flat[i - 1] == Tok::Punct('.');
                if after_dot && flat.get(i + 1) == Some(&Tok::Open('(')) {
                    self.called(first.clone());
                } else if !after_path && flat.get(i + 1) == Some(&Tok::Colons) {
                    let mut path = vec![first.clone()];
                    let mut j = i + 1;
                    while flat.get(j) == Some(&Tok::Colons) {
                        match flat.get(j + 1) {
                            Some(Tok::Ident(s)) => path.push(s.clone()),
                            _ => break,
                        }
                        j += 2;
                    }
                    self.named(path);
                    i = j;
                    continue;
                }
            }
            i += 1;
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Colons,
    Punct(char),
    /// The start of a group: `(`, `[`, `{`.
    Open(char),
    Other,
}

/// A token stream, groups opened in place.
fn flatten(tokens: proc_macro2::TokenStream) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut joint_colon = false;
    for t in tokens {
        match t {
            proc_macro2::TokenTree::Ident(i) => out.push(Tok::Ident(i.to_string())),
            proc_macro2::TokenTree::Punct(p) => {
                if p.as_char() == ':' && joint_colon {
                    out.pop();
                    out.push(Tok::Colons);
                    joint_colon = false;
                    continue;
                }
                joint_colon = p.as_char() == ':' && p.spacing() == proc_macro2::Spacing::Joint;
                out.push(Tok::Punct(p.as_char()));
                continue;
            }
            proc_macro2::TokenTree::Group(g) => {
                let open = match g.delimiter() {
                    proc_macro2::Delimiter::Parenthesis => '(',
                    proc_macro2::Delimiter::Bracket => '[',
                    proc_macro2::Delimiter::Brace => '{',
                    proc_macro2::Delimiter::None => ' ',
                };
                out.push(Tok::Open(open));
                out.extend(flatten(g.stream()));
            }
            proc_macro2::TokenTree::Literal(_) => out.push(Tok::Other),
        }
        joint_colon = false;
    }
    out
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs: &[syn::Attribute] = match item {
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::ExternCrate(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::ForeignMod(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::TraitAlias(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Union(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            _ => &[],
        };
        if is_cfg_test(attrs) {
            if let syn::Item::Mod(m) = item {
                let mut child = self.module.clone();
                child.push(m.ident.to_string());
                self.test_children.insert(child);
            }
            return;
        }
        let name = match item {
            syn::Item::Const(i) => Some(&i.ident),
            syn::Item::Enum(i) => Some(&i.ident),
            syn::Item::Fn(i) => Some(&i.sig.ident),
            syn::Item::Macro(i) => i.ident.as_ref(),
            syn::Item::Static(i) => Some(&i.ident),
            syn::Item::Struct(i) => Some(&i.ident),
            syn::Item::Trait(i) => Some(&i.ident),
            syn::Item::Type(i) => Some(&i.ident),
            syn::Item::Union(i) => Some(&i.ident),
            _ => None,
        };
        if let Some(name) = name {
            self.bind(name.to_string(), Binding::Item);
        }
        let mut fields = Paths::default();
        match item {
            syn::Item::Struct(s) => fields.visit_fields(&s.fields),
            syn::Item::Enum(e) => {
                for v in &e.variants {
                    fields.visit_fields(&v.fields);
                }
            }
            _ => {}
        }
        if let (Some(name), false) = (name, fields.found.is_empty()) {
            self.facts
                .fields
                .insert((self.module.clone(), name.to_string()), fields.found);
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let mut child = self.module.clone();
        child.push(m.ident.to_string());
        self.bind(m.ident.to_string(), Binding::Module(child.clone()));
        if let Some((_, items)) = &m.content {
            self.facts.file_of.insert(child.clone(), self.file.clone());
            let outer = std::mem::replace(&mut self.module, child);
            for item in items {
                self.visit_item(item);
            }
            self.module = outer;
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&u.tree, &[]);
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        let syn::Type::Path(tp) = &*i.self_ty else {
            return syn::visit::visit_item_impl(self, i);
        };
        let self_ty = segments(&tp.path);
        let mut imp = Impl {
            written_in: self.module.clone(),
            self_ty: self_ty.clone(),
            trait_: i.trait_.as_ref().map(|(_, p, _)| segments(p)),
            ..Impl::default()
        };
        for item in &i.items {
            if let syn::ImplItem::Fn(f) = item {
                if is_cfg_test(&f.attrs) {
                    continue;
                }
                imp.methods.push(f.sig.ident.to_string());
                let mut ret = Paths {
                    self_ty: self_ty.clone(),
                    ..Paths::default()
                };
                ret.visit_return_type(&f.sig.output);
                imp.returns.extend(ret.found);
            }
        }
        self.facts.impls.push(imp);
        let outer = std::mem::replace(&mut self.self_ty, self_ty);
        syn::visit::visit_item_impl(self, i);
        self.self_ty = outer;
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_cfg_test(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.named(segments(p));
        syn::visit::visit_path(self, p);
    }

    /// `pub(super)`, `pub(in crate::x)`: who may see, not what is used.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        self.called(m.method.to_string());
        syn::visit::visit_expr_method_call(self, m);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.named(segments(&m.path));
        self.macro_tokens(&m.tokens);
    }
}

/// The crate as read: every module's facts, and the files' edges.
struct Crate {
    facts: Facts,
    /// Every file module (the nodes), test-only ones left out.
    files: BTreeSet<Mod>,
}

/// The crate under `src/`, read once for every test.
fn read_crate() -> &'static Crate {
    static CRATE: std::sync::OnceLock<Crate> = std::sync::OnceLock::new();
    CRATE.get_or_init(read_src)
}

/// Read `src/` (without `main.rs`, the binary: a crate of its own).
fn read_src() -> Crate {
    parse_crate(src_texts())
}

/// The files under `src/` (without `main.rs`), read once: (path under
/// `src/`, text).
fn src_texts() -> &'static BTreeMap<PathBuf, String> {
    static TEXTS: std::sync::OnceLock<BTreeMap<PathBuf, String>> = std::sync::OnceLock::new();
    TEXTS.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut texts = BTreeMap::new();
        for file in files {
            let rel = file.strip_prefix(&src).unwrap().to_path_buf();
            if rel != Path::new("main.rs") {
                texts.insert(rel.clone(), std::fs::read_to_string(&file).unwrap());
            }
        }
        texts
    })
}

/// Parse a crate given as (path under `src/`, text).
fn parse_crate(texts: &BTreeMap<PathBuf, String>) -> Crate {
    let mut facts = Facts::default();
    let mut test_children = BTreeSet::new();
    for (rel, text) in texts {
        let module = module_of(rel);
        let ast = syn::parse_file(text).unwrap_or_else(|e| panic!("src/{}: {e}", rel.display()));
        facts.file_of.insert(module.clone(), module.clone());
        let mut c = Collector {
            facts: &mut facts,
            file: module.clone(),
            module: module.clone(),
            self_ty: Vec::new(),
            test_children: &mut test_children,
        };
        for item in &ast.items {
            c.visit_item(item);
        }
    }
    let in_test = |m: &Mod| test_children.iter().any(|t| m.starts_with(t));
    let files: BTreeSet<Mod> = texts
        .keys()
        .map(|rel| module_of(rel))
        .filter(|m| !in_test(m))
        .collect();
    facts.refs.retain(|m, _| !in_test(m));
    facts.calls.retain(|m, _| !in_test(m));
    facts.impls.retain(|i| !in_test(&i.written_in));
    Crate { facts, files }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

// ---------------------------------------------------------------------
// Resolving names

/// How deep an import may lead through others (globs and re-exports).
const MAX_HOPS: usize = 16;

impl Crate {
    /// What `path`, written in module `here`, names; `None` for a local
    /// name (a variable, a generic) or something in the prelude.
    fn resolve(&self, here: &Mod, path: &[String]) -> Option<Res> {
        self.resolve_in(here, path, 0)
    }

    fn resolve_in(&self, here: &Mod, path: &[String], hops: usize) -> Option<Res> {
        if hops > MAX_HOPS {
            return None;
        }
        let (first, rest) = path.split_first()?;
        let start = match first.as_str() {
            "crate" => Res::Module(Vec::new()),
            "self" => Res::Module(here.clone()),
            "super" => {
                let mut at = here.clone();
                at.pop()?;
                Res::Module(at)
            }
            name => match self.lookup(here, name, hops) {
                Some(r) => r,
                // A crate outside (`std`, `tokio`), or the prelude.
                None if rest.is_empty() => return None,
                None => return Some(Res::External(path.to_vec())),
            },
        };
        self.walk(start, rest, hops)
    }

    /// Follow `rest` from `at`.
    fn walk(&self, mut at: Res, rest: &[String], hops: usize) -> Option<Res> {
        for (i, seg) in rest.iter().enumerate() {
            match at {
                Res::Module(ref m) if seg == "super" => {
                    let mut up = m.clone();
                    up.pop()?;
                    at = Res::Module(up);
                }
                Res::Module(ref m) => match self.lookup(m, seg, hops) {
                    Some(next) => at = next,
                    // Made by a macro, or not there: the module is named.
                    None => return Some(at),
                },
                Res::Item { at: m, name, .. } => {
                    return Some(Res::Item {
                        at: m,
                        name,
                        rest: rest[i..].to_vec(),
                    })
                }
                Res::External(mut p) => {
                    p.extend(rest[i..].iter().cloned());
                    return Some(Res::External(p));
                }
            }
        }
        Some(at)
    }

    /// A name in the scope of module `m`: its own items, modules and
    /// imports, then its globs.
    fn lookup(&self, m: &Mod, name: &str, hops: usize) -> Option<Res> {
        let bindings = self.facts.scope.get(m).and_then(|s| s.get(name));
        for b in bindings.into_iter().flatten() {
            match b {
                Binding::Module(child) => return Some(Res::Module(child.clone())),
                Binding::Item => {
                    return Some(Res::Item {
                        at: m.clone(),
                        name: name.to_string(),
                        rest: Vec::new(),
                    })
                }
                Binding::Import(path) => {
                    if let Some(r) = self.resolve_in(m, path, hops + 1) {
                        return Some(r);
                    }
                }
            }
        }
        for glob in self.facts.globs.get(m).into_iter().flatten() {
            if let Some(Res::Module(g)) = self.resolve_in(m, glob, hops + 1) {
                if let Some(r) = self.lookup(&g, name, hops + 1) {
                    return Some(r);
                }
            }
        }
        None
    }

    /// The file a module is written in.
    fn file(&self, m: &Mod) -> Mod {
        self.facts
            .file_of
            .get(m)
            .cloned()
            .unwrap_or_else(|| m.clone())
    }

    /// Every type of the crate, by (module, name): the files of the `impl`
    /// blocks defining each of its methods, and the types its fields and
    /// its methods' return types name.
    fn types(&self) -> BTreeMap<(Mod, String), TypeInfo> {
        let mut types: BTreeMap<(Mod, String), TypeInfo> = BTreeMap::new();
        for imp in &self.facts.impls {
            let Some(Res::Item { at, name, rest }) = self.resolve(&imp.written_in, &imp.self_ty)
            else {
                continue;
            };
            if !rest.is_empty() {
                continue;
            }
            // Methods of a trait outside the crate are called through it
            // (`Display`, `Drop`, `Future`): no edge by their names.
            let crate_trait = match &imp.trait_ {
                None => true,
                Some(t) => matches!(self.resolve(&imp.written_in, t), Some(Res::Item { .. })),
            };
            let info = types.entry((at, name)).or_default();
            if crate_trait {
                for method in &imp.methods {
                    info.methods
                        .entry(method.clone())
                        .or_default()
                        .insert(self.file(&imp.written_in));
                }
            }
            for ret in &imp.returns {
                if let Some(Res::Item { at, name, .. }) = self.resolve(&imp.written_in, ret) {
                    info.reaches.insert((at, name));
                }
            }
        }
        for ((m, name), paths) in &self.facts.fields {
            for p in paths {
                if let Some(Res::Item { at, name: n, .. }) = self.resolve(m, p) {
                    types
                        .entry((m.clone(), name.clone()))
                        .or_default()
                        .reaches
                        .insert((at, n));
                }
            }
        }
        types
    }

    /// Each file's edges: the files it names (through imports and
    /// re-exports, to where the item is defined), and the files of the
    /// `impl` blocks of the methods it calls on the types it reaches.
    fn edges(&self) -> BTreeMap<Mod, BTreeSet<Mod>> {
        let types = self.types();
        let mut edges: BTreeMap<Mod, BTreeSet<Mod>> = BTreeMap::new();
        for file in &self.files {
            let out = edges.entry(file.clone()).or_default();
            let mut reach: BTreeSet<(Mod, String)> = BTreeSet::new();
            for (here, path) in self.facts.refs.get(file).into_iter().flatten() {
                match self.resolve(here, path) {
                    Some(Res::Module(m)) => {
                        out.insert(self.file(&m));
                    }
                    Some(Res::Item { at, name, rest }) => {
                        out.insert(self.file(&at));
                        // `Type::method`: the file of that method's impl.
                        if let Some(files) = rest
                            .first()
                            .and_then(|m| types.get(&(at.clone(), name.clone()))?.methods.get(m))
                        {
                            out.extend(files.iter().cloned());
                        }
                        reach.insert((at, name));
                    }
                    Some(Res::External(_)) | None => {}
                }
            }
            // The types reachable from those named: through fields and
            // what methods return, as `a.b.c().d()` is.
            let mut todo: Vec<(Mod, String)> = reach.iter().cloned().collect();
            while let Some(t) = todo.pop() {
                for next in types.get(&t).into_iter().flat_map(|i| &i.reaches) {
                    if reach.insert(next.clone()) {
                        todo.push(next.clone());
                    }
                }
            }
            for method in self.facts.calls.get(file).into_iter().flatten() {
                for t in &reach {
                    if let Some(files) = types.get(t).and_then(|i| i.methods.get(method)) {
                        out.extend(files.iter().cloned());
                    }
                }
            }
            out.remove(file);
            out.retain(|m| self.files.contains(m));
        }
        edges
    }

    /// What each file names outside the crate (absolute paths), and the
    /// methods it calls.
    fn external(&self, file: &Mod) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut paths = BTreeSet::new();
        for (here, path) in self.facts.refs.get(file).into_iter().flatten() {
            if let Some(Res::External(p)) = self.resolve(here, path) {
                paths.insert(p.join("::"));
            }
        }
        let calls = self.facts.calls.get(file).cloned().unwrap_or_default();
        (paths, calls)
    }
}

#[derive(Debug, Default)]
struct TypeInfo {
    /// Method name: the files of the `impl` blocks defining it.
    methods: BTreeMap<String, BTreeSet<Mod>>,
    /// Types named by its fields and its methods' return types.
    reaches: BTreeSet<(Mod, String)>,
}

// ---------------------------------------------------------------------
// The graphs and the rules

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The folder's own file (`mod.rs`, `lib.rs` at the top) as a node.
const OWN: &str = "mod.rs";

/// The graph of the files of `folder`: each child (a file, or a subfolder
/// with everything in it) and the folder's own file, by their edges.
fn folder_graph(edges: &BTreeMap<Mod, BTreeSet<Mod>>, folder: &[String]) -> Graph {
    let node = |m: &Mod| -> Option<String> {
        if !m.starts_with(folder) {
            return None;
        }
        Some(m.get(folder.len()).cloned().unwrap_or_else(|| OWN.into()))
    };
    let mut graph = Graph::new();
    for (file, targets) in edges {
        let Some(from) = node(file) else { continue };
        let deps = graph.entry(from.clone()).or_default();
        for to in targets.iter().filter_map(node) {
            if to != from {
                deps.insert(to);
            }
        }
    }
    graph
}

/// Folders: the modules with file modules below them.
fn folders(krate: &Crate) -> Vec<Mod> {
    let mut out: BTreeSet<Mod> = BTreeSet::new();
    for m in &krate.files {
        for len in 0..m.len() {
            out.insert(m[..len].to_vec());
        }
    }
    out.into_iter().collect()
}

/// A path from `from` back to `to`, if there is one.
fn path_back(
    graph: &Graph,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in graph.get(from).into_iter().flatten() {
        if let Some(mut rest) = path_back(graph, next, to, seen) {
            rest.insert(0, from.to_string());
            return Some(rest);
        }
    }
    None
}

/// Each cycle of `graph` once, as `a -> b -> a` starting at its least node.
fn cycles(graph: &Graph) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (module, deps) in graph {
        for dep in deps {
            if let Some(path) = path_back(graph, dep, module, &mut BTreeSet::new()) {
                let mut ring: Vec<String> = std::iter::once(module.clone()).chain(path).collect();
                ring.pop();
                let least = (0..ring.len()).min_by_key(|i| &ring[*i]).unwrap();
                ring.rotate_left(least);
                ring.push(ring[0].clone());
                out.insert(ring.join(" -> "));
            }
        }
    }
    out
}

fn folder_name(folder: &[String]) -> String {
    format!("src/{}", folder.join("/"))
}

/// Rule 1: every cycle of every folder, named with its folder.
fn cycle_violations(krate: &Crate) -> Vec<String> {
    let edges = krate.edges();
    let mut found = Vec::new();
    for folder in folders(krate) {
        for cycle in cycles(&folder_graph(&edges, &folder)) {
            found.push(format!("{}: {cycle}", folder_name(&folder)));
        }
    }
    found
}

/// Rule 2: who names `proxy/` from below it, and the edges inside it that
/// run back up its layers (and the files not placed in a layer).
fn proxy_violations(krate: &Crate) -> (Vec<String>, Vec<String>, Vec<String>) {
    let edges = krate.edges();
    let proxy = vec!["proxy".to_string()];
    let mut below = Vec::new();
    for (file, targets) in &edges {
        let top = file.first().map(String::as_str).unwrap_or(OWN);
        if file.starts_with(&proxy) || ABOVE_PROXY.contains(&top) || file.is_empty() {
            continue;
        }
        for t in targets.iter().filter(|t| t.starts_with(&proxy)) {
            below.push(format!("{} -> {}", file.join("::"), t.join("::")));
        }
    }
    let graph = folder_graph(&edges, &proxy);
    let layer = |name: &str| PROXY_LAYERS.iter().position(|l| l.contains(&name));
    let unplaced: Vec<String> = graph
        .keys()
        .filter(|n| *n != OWN && layer(n).is_none())
        .cloned()
        .collect();
    let mut back_up = Vec::new();
    for (from, deps) in &graph {
        let Some(at) = layer(from) else { continue };
        for to in deps {
            if layer(to).is_some_and(|l| l < at) {
                back_up.push(format!("{from} -> {to}"));
            }
        }
    }
    (below, back_up, unplaced)
}

/// Rule 3: what the pure parts name that reads a clock, uses tokio or
/// does I/O.
fn purity_violations(krate: &Crate) -> Vec<String> {
    let mut found = Vec::new();
    for file in &krate.files {
        let rel = file.join("/");
        let pure = PURE.iter().any(|p| match p.strip_suffix('/') {
            Some(folder) => rel == folder || rel.starts_with(&format!("{folder}/")),
            None => format!("{rel}.rs") == *p,
        });
        if !pure {
            continue;
        }
        let (paths, calls) = krate.external(file);
        for p in &paths {
            if IMPURE_PATHS
                .iter()
                .any(|bad| p == bad || p.starts_with(&format!("{bad}::")))
            {
                found.push(format!("src/{rel}: {p}"));
            }
        }
        for m in calls
            .iter()
            .filter(|m| IMPURE_METHODS.contains(&m.as_str()))
        {
            found.push(format!("src/{rel}: .{m}()"));
        }
    }
    found
}

/// Rule 4: the production functions longer than [`MAX_FN_LINES`], as
/// `src/FILE: NAME (LINES lines)`, and the [`LONG_FNS_ALLOWED`] entries no
/// such function stands for any more.
fn length_violations(
    krate: &Crate,
    texts: &BTreeMap<PathBuf, String>,
    allowed: &[(&str, &str, &str)],
) -> (Vec<String>, Vec<String>) {
    let mut long = Vec::new();
    let mut seen = BTreeSet::new();
    for (rel, text) in texts {
        if !krate.files.contains(&module_of(rel)) {
            continue;
        }
        let file = rel.to_string_lossy().to_string();
        let ast = syn::parse_file(text).unwrap_or_else(|e| panic!("src/{file}: {e}"));
        let mut lengths = Lengths::default();
        lengths.visit_file(&ast);
        for (name, lines) in lengths.found {
            if lines <= MAX_FN_LINES {
                continue;
            }
            if allowed.iter().any(|(f, n, _)| *f == file && *n == name) {
                seen.insert((file.clone(), name));
            } else {
                long.push(format!("src/{file}: {name} ({lines} lines)"));
            }
        }
    }
    let stale = allowed
        .iter()
        .filter(|(f, n, _)| !seen.contains(&(f.to_string(), n.to_string())))
        .map(|(f, n, _)| format!("src/{f}: {n}"))
        .collect();
    (long, stale)
}

/// The functions of one file, `#[cfg(test)]` and `#[test]` ones left out:
/// (`name`, or `Type::name` in an `impl` or `trait`, lines from `fn` to
/// the closing brace).
#[derive(Default)]
struct Lengths {
    self_ty: Option<String>,
    found: Vec<(String, usize)>,
}

impl Lengths {
    fn function(&mut self, attrs: &[syn::Attribute], sig: &syn::Signature, block: &syn::Block) {
        if is_cfg_test(attrs) || attrs.iter().any(|a| a.path().is_ident("test")) {
            return;
        }
        let first = sig.fn_token.span.start().line;
        let last = block.brace_token.span.close().end().line;
        let name = match &self.self_ty {
            Some(ty) => format!("{ty}::{}", sig.ident),
            None => sig.ident.to_string(),
        };
        self.found.push((name, last + 1 - first));
    }
}

impl<'ast> Visit<'ast> for Lengths {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.function(&f.attrs, &f.sig, &f.block);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.function(&f.attrs, &f.sig, &f.block);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.function(&f.attrs, &f.sig, block);
        }
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if is_cfg_test(&i.attrs) {
            return;
        }
        let ty = match &*i.self_ty {
            syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
            _ => None,
        };
        let outer = std::mem::replace(&mut self.self_ty, ty);
        syn::visit::visit_item_impl(self, i);
        self.self_ty = outer;
    }

    fn visit_item_trait(&mut self, t: &'ast syn::ItemTrait) {
        if is_cfg_test(&t.attrs) {
            return;
        }
        let outer = self.self_ty.replace(t.ident.to_string());
        syn::visit::visit_item_trait(self, t);
        self.self_ty = outer;
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_cfg_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }
}

// ---------------------------------------------------------------------
// The rules, on the crate

#[test]
fn no_folder_has_a_cycle() {
    let krate = read_crate();
    let edges = krate.edges();
    let top = folder_graph(&edges, &[]);
    let proxy = folder_graph(&edges, &["proxy".to_string()]);
    assert!(
        top.len() >= 10
            && top["proxy"].contains("policy")
            && proxy.len() >= 10
            && proxy["connect"].contains("verify"),
        "the scan found too little: {top:?}"
    );
    let found = cycle_violations(krate);
    assert!(found.is_empty(), "cycles:\n{}", found.join("\n"));
}

#[test]
fn nothing_below_proxy_names_it_and_proxy_runs_down_its_layers() {
    let krate = read_crate();
    let (below, back_up, unplaced) = proxy_violations(krate);
    assert!(
        below.is_empty(),
        "modules below src/proxy name it (only {ABOVE_PROXY:?} may):\n{}",
        below.join("\n")
    );
    assert!(
        unplaced.is_empty(),
        "place these files of src/proxy in PROXY_LAYERS: {unplaced:?}"
    );
    assert!(
        back_up.is_empty(),
        "edges running back up inside src/proxy:\n{}",
        back_up.join("\n")
    );
}

#[test]
fn the_pure_parts_read_no_clock_use_no_tokio_and_do_no_io() {
    let krate = read_crate();
    let found = purity_violations(krate);
    assert!(found.is_empty(), "impure:\n{}", found.join("\n"));
}

#[test]
fn no_production_function_is_longer_than_the_limit() {
    let krate = read_crate();
    let (long, stale) = length_violations(krate, src_texts(), LONG_FNS_ALLOWED);
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines: split them into named steps\n{}",
        long.join("\n")
    );
    assert!(
        stale.is_empty(),
        "LONG_FNS_ALLOWED entries no longer over {MAX_FN_LINES} lines (delete them):\n{}",
        stale.join("\n")
    );
}

// ---------------------------------------------------------------------
// Each rule catches what it is for: small made-up crates

fn made_up(files: &[(&str, &str)]) -> Crate {
    let texts = files
        .iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
    parse_crate(&texts)
}

const LIB: &str = "pub mod a; pub mod b;";

#[test]
fn a_cycle_through_plain_imports_is_caught() {
    let k = made_up(&[
        ("lib.rs", LIB),
        ("a.rs", "use crate::b::B; pub struct A;"),
        ("b.rs", "pub struct B(crate::a::A);"),
    ]);
    assert_eq!(cycle_violations(&k), vec!["src/: a -> b -> a"]);
    // Comments, strings and test code name nothing.
    let k = made_up(&[
        ("lib.rs", LIB),
        ("a.rs", "use crate::b::B; pub struct A;"),
        (
            "b.rs",
            r#"// crate::a::A
            /// [`crate::a::A`]
            pub fn f() -> &'static str { "crate::a::A" }
            #[cfg(test)]
            mod tests { use crate::a::A; }
            #[cfg(test)]
            fn g() { crate::a::A; }"#,
        ),
    ]);
    assert_eq!(cycle_violations(&k), Vec::<String>::new());
}

#[test]
fn a_cycle_through_a_method_in_an_impl_block_of_another_file_is_caught() {
    // `a` names nothing of `b`: it calls `ctx.decide()`, defined in an
    // `impl Ctx` block written in `b`, which names `Ctx`.
    let k = made_up(&[
        ("lib.rs", LIB),
        (
            "a.rs",
            "pub struct Ctx; pub fn run(ctx: &Ctx) { ctx.decide(); }",
        ),
        ("b.rs", "impl crate::a::Ctx { pub fn decide(&self) {} }"),
    ]);
    assert_eq!(cycle_violations(&k), vec!["src/: a -> b -> a"]);
    // Through a field and what a method returns, and `Type::method`.
    let k = made_up(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c;"),
        (
            "a.rs",
            "pub struct Conn { pub ctx: Ctx } pub struct Ctx;
             impl Ctx { pub fn view(&self) -> crate::c::View { todo!() } }
             pub fn run(conn: &Conn) { conn.ctx.view().record(); }",
        ),
        ("b.rs", "impl crate::c::View { pub fn record(&self) {} }"),
        ("c.rs", "pub struct View; pub fn f() { crate::b::g(); }"),
    ]);
    assert!(
        cycle_violations(&k).contains(&"src/: b -> c -> b".to_string()),
        "{:?}",
        cycle_violations(&k)
    );
    let k = made_up(&[
        ("lib.rs", LIB),
        ("a.rs", "pub struct Ctx; pub fn run() { Ctx::decide(); }"),
        ("b.rs", "use crate::a::Ctx; impl Ctx { pub fn decide() {} }"),
    ]);
    assert_eq!(cycle_violations(&k), vec!["src/: a -> b -> a"]);
}

#[test]
fn a_cycle_through_a_re_export_of_a_folder_is_caught() {
    // `x/one` names `super::Two`, which `x/mod.rs` re-exports from
    // `x/two`: the edge is to `two`, where it is defined.
    let k = made_up(&[
        ("lib.rs", "pub mod x;"),
        (
            "x/mod.rs",
            "mod one; mod two; pub use two::Two; pub use one::*;",
        ),
        ("x/one.rs", "pub struct One(super::Two);"),
        ("x/two.rs", "pub struct Two(Box<crate::x::One>);"),
    ]);
    let found = cycle_violations(&k);
    assert!(
        found.contains(&"src/x: one -> two -> one".to_string()),
        "{found:?}"
    );
}

#[test]
fn a_loop_between_mod_rs_and_a_child_is_caught() {
    let k = made_up(&[
        ("lib.rs", "pub mod x;"),
        (
            "x/mod.rs",
            "mod kid; pub struct Shared; pub fn f() { kid::g(); }",
        ),
        ("x/kid.rs", "pub fn g() -> super::Shared { super::Shared }"),
    ]);
    assert_eq!(cycle_violations(&k), vec!["src/x: kid -> mod.rs -> kid"]);
    // Declaring a child and re-exporting it is no loop by itself.
    let k = made_up(&[
        ("lib.rs", "pub mod x;"),
        ("x/mod.rs", "mod kid; pub use kid::g;"),
        ("x/kid.rs", "pub fn g() {}"),
    ]);
    assert_eq!(cycle_violations(&k), Vec::<String>::new());
}

#[test]
fn a_layer_below_proxy_naming_it_is_caught() {
    let k = made_up(&[
        ("lib.rs", "pub mod proxy; pub mod dns; pub mod app;"),
        ("proxy/mod.rs", "pub mod listen; pub mod connect;"),
        ("proxy/listen.rs", "pub struct Listener;"),
        ("proxy/connect.rs", "use super::listen::Listener;"),
        ("dns/mod.rs", "use crate::proxy::listen::Listener;"),
        ("app.rs", "use crate::proxy::listen::Listener;"),
    ]);
    let (below, back_up, unplaced) = proxy_violations(&k);
    assert_eq!(below, vec!["dns -> proxy::listen"]);
    assert_eq!(back_up, vec!["connect -> listen"]);
    assert_eq!(unplaced, Vec::<String>::new());
}

#[test]
fn a_clock_tokio_or_io_in_a_pure_part_is_caught() {
    let k = made_up(&[
        ("lib.rs", "pub mod policy; pub mod proxy;"),
        (
            "policy/mod.rs",
            "use std::time::Instant;
             use std::fs;
             pub fn f(t: Instant) -> bool {
                 let _ = fs::read(\"x\");
                 let _ = std::time::SystemTime::now();
                 t.elapsed().as_secs() > 1 && Instant::now() > t
             }
             pub async fn g() { tokio::task::yield_now().await }",
        ),
        // Not a pure part: may.
        ("proxy/mod.rs", "pub fn h() { std::time::Instant::now(); }"),
    ]);
    assert_eq!(
        purity_violations(&k),
        vec![
            "src/policy: std::fs",
            "src/policy: std::fs::read",
            "src/policy: std::time::Instant::now",
            "src/policy: std::time::SystemTime::now",
            "src/policy: tokio::task::yield_now",
            "src/policy: .elapsed()",
        ]
    );
    // `now` passed in is pure.
    let k = made_up(&[
        ("lib.rs", "pub mod policy;"),
        (
            "policy/mod.rs",
            "use std::time::{Duration, Instant};
             pub fn f(now: Instant, t: Instant) -> Duration { now - t }",
        ),
    ]);
    assert_eq!(purity_violations(&k), Vec::<String>::new());
}

// ---------------------------------------------------------------------
// Unsafe

/// The crate's only `unsafe` is the one block `lib.rs` names (the
/// SO_RCVLOWAT setsockopt in `proxy/splice.rs`), and it carries its proof:
/// a `SAFETY:` comment right above it. Any other `unsafe` (outside comments
/// and strings) fails here, as `#![deny(unsafe_code)]` fails the build
/// unless allowed.
#[test]
fn a_long_function_is_caught_but_not_a_test_and_a_stale_allowance_fails() {
    let body = "    let _ = 1;\n".repeat(MAX_FN_LINES);
    let texts: BTreeMap<PathBuf, String> = [
        ("lib.rs", "pub mod a; #[cfg(test)] mod t;".to_string()),
        (
            "a.rs",
            format!(
                "pub fn short() {{}}\npub struct S;\nimpl S {{\n    fn long(&self) {{\n{body}    }}\n}}\n\
                 #[cfg(test)]\nmod tests {{\n    fn helper() {{\n{body}    }}\n}}\n"
            ),
        ),
        ("t.rs", format!("fn in_a_test_file() {{\n{body}}}\n")),
    ]
    .into_iter()
    .map(|(p, t)| (PathBuf::from(p), t))
    .collect();
    let krate = parse_crate(&texts);
    let (long, stale) = length_violations(&krate, &texts, &[]);
    assert_eq!(
        long,
        vec![format!("src/a.rs: S::long ({} lines)", MAX_FN_LINES + 2)]
    );
    assert!(stale.is_empty());
    let allowed = [("a.rs", "S::long", "why"), ("a.rs", "short", "stale")];
    let (long, stale) = length_violations(&krate, &texts, &allowed);
    assert!(long.is_empty(), "{long:?}");
    assert_eq!(stale, vec!["src/a.rs: short".to_string()]);
}

#[test]
fn the_one_unsafe_block_is_where_lib_rs_says_and_proved_sound() {
    let mut files = Vec::new();
    rust_files(Path::new("src"), &mut files);
    files.sort();
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let tokens = proc_macro2::TokenStream::from_str(&text).unwrap();
        let n = flatten(tokens)
            .iter()
            .filter(|t| matches!(t, Tok::Ident(i) if i == "unsafe"))
            .count();
        if n > 0 {
            found.push((f.clone(), n, text));
        }
    }
    assert_eq!(
        found
            .iter()
            .map(|(f, n, _)| (f.clone(), *n))
            .collect::<Vec<_>>(),
        vec![(PathBuf::from("src/proxy/splice.rs"), 1)],
        "unsafe outside the one place src/lib.rs names"
    );
    let text = &found[0].2;
    let at = text.find("unsafe {").expect("the unsafe block");
    let before = &text[..at];
    let comment = before.rfind("// SAFETY:").expect("a SAFETY: comment");
    assert!(
        before[comment..].lines().count() <= 8,
        "the SAFETY: comment is not right above the block"
    );
}
