//! `[bypass]`: the NFLOG group of the packets the gateway ruleset rejects.

use crate::config::error::Errors;
use crate::config::model::BypassConfig;
use crate::config::raw::RawBypass;

pub(super) fn validate_bypass(raw: RawBypass, errors: &mut Errors<'_>) -> BypassConfig {
    let RawBypass { nflog_group } = raw;
    let nflog_group = nflog_group.and_then(|g| match u16::try_from(*g.get_ref()) {
        Ok(n) => Some(n),
        Err(_) => {
            errors.at(
                g.span(),
                format!(
                    "nflog_group {} must be an NFLOG group number, 0 to 65535",
                    g.get_ref()
                ),
            );
            None
        }
    });
    BypassConfig { nflog_group }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{parse, BASE};

    #[test]
    fn the_group_is_read_and_bounded() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.bypass.nflog_group, None, "unset: nothing is read");
        let c = parse(&format!("[bypass]\nnflog_group = 100\n{BASE}")).unwrap();
        assert_eq!(c.bypass.nflog_group, Some(100));
        for bad in ["-1", "65536", "\"7\""] {
            let e = parse(&format!("[bypass]\nnflog_group = {bad}\n{BASE}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(":2:"), "{bad}: located at the key: {e}");
            assert!(
                e.contains("nflog_group") || e.contains("invalid type"),
                "{bad}: {e}"
            );
        }
    }
}
