//! The checkpoint signing key: an Ed25519 secret seed stored as 64 hex
//! characters and a newline, in a file only its owner may read (0600).
//! Generated on first start when missing; refused when group or others
//! may read or write it.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use data_encoding::HEXLOWER;
use ed25519_dalek::SigningKey;

use super::chain::unhex;

fn bad(path: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("signing key {}: {what}", path.display()))
}

/// Read the key at `path`.
pub(crate) fn load(path: &Path) -> io::Result<SigningKey> {
    let meta = fs::metadata(path).map_err(|e| bad(path, e))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(bad(
            path,
            format!("mode {mode:04o} lets others read it; chmod 600"),
        ));
    }
    let text = fs::read_to_string(path).map_err(|e| bad(path, e))?;
    let seed = unhex::<32>(&text).ok_or_else(|| bad(path, "not 64 hex characters"))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Read the key at `path`, creating it (mode 0600) if it does not exist.
pub(crate) fn load_or_create(path: &Path) -> io::Result<SigningKey> {
    match fs::symlink_metadata(path) {
        Ok(_) => return load(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bad(path, e)),
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| bad(path, e))?;
    }
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| bad(path, format!("no randomness: {e}")))?;
    let key = SigningKey::from_bytes(&seed);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| bad(path, e))?;
    f.write_all(format!("{}\n", HEXLOWER.encode(&seed)).as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| bad(path, e))?;
    // The umask may only remove bits; make sure it is exactly 0600.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(|e| bad(path, e))?;
    seed.fill(0);
    Ok(key)
}

/// The public key as hex, the form `palisade evidence pubkey` prints and
/// `verify --key` takes.
pub(crate) fn public_hex(key: &SigningKey) -> String {
    HEXLOWER.encode(key.verifying_key().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_0600_reloaded_and_refused_when_open() {
        let dir = crate::testing::scratch("key").join("keys");
        let path = dir.join("k");
        let a = load_or_create(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let b = load_or_create(&path).unwrap();
        assert_eq!(public_hex(&a), public_hex(&b));
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("0644"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }
}
