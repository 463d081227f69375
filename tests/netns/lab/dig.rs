//! `dig` output, parsed.

/// What `dig` printed, parsed.
#[derive(Debug, Clone, Default)]
pub struct Dig {
    /// `NOERROR`, `NXDOMAIN`, `REFUSED`, ... (empty when no reply arrived).
    pub status: String,
    /// Answer section: (type, rdata), e.g. ("A", "198.18.2.10").
    pub answers: Vec<(String, String)>,
    /// The Extended DNS Error line, e.g. `15 (Blocked): (palisade: ...)`.
    pub ede: Option<String>,
    pub output: String,
    pub exit: Option<i32>,
}

impl Dig {
    pub fn parse(text: &str, exit: Option<i32>) -> Dig {
        let mut d = Dig {
            output: text.to_owned(),
            exit,
            ..Dig::default()
        };
        let mut in_answer = false;
        for line in text.lines() {
            if let Some(rest) = line.split("status: ").nth(1) {
                d.status = rest.split(',').next().unwrap_or("").trim().to_owned();
            }
            if let Some(rest) = line.strip_prefix("; EDE: ") {
                d.ede = Some(rest.to_owned());
            }
            if line.starts_with(";; ANSWER SECTION:") {
                in_answer = true;
                continue;
            }
            if in_answer {
                if line.trim().is_empty() || line.starts_with(';') {
                    in_answer = false;
                    continue;
                }
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() >= 5 {
                    d.answers.push((f[3].to_owned(), f[4..].join(" ")));
                }
            }
        }
        d
    }

    /// rdata of the answers of one type.
    pub fn of(&self, rtype: &str) -> Vec<String> {
        self.answers
            .iter()
            .filter(|(t, _)| t == rtype)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The record reference named in the EDE text (`record=REF`).
    pub fn record_id(&self) -> Option<String> {
        let ede = self.ede.as_deref()?;
        let rest = ede.split("record=").nth(1)?;
        Some(
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect(),
        )
    }
}
