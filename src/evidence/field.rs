//! Fields of records and proofs read as JSON: a field that is missing, or
//! of another type, is an error the caller words.

use serde_json::{Map, Value};

/// A JSON object's fields by name: a record (a `Map`) or a proof (a
/// `Value`).
pub(crate) trait Fields {
    /// The field `key`, if there is one.
    fn field(&self, key: &str) -> Option<&Value>;

    /// The field `key` as text, if it is text.
    fn text(&self, key: &str) -> Option<&str> {
        self.field(key).and_then(Value::as_str)
    }

    /// The field `key` as text, else the error `missing()`.
    fn need_text<E: Into<String>>(
        &self,
        key: &str,
        missing: impl FnOnce() -> E,
    ) -> Result<&str, String> {
        self.text(key).ok_or_else(|| missing().into())
    }

    /// The field `key` as a whole number, else the error `missing()`.
    fn need_u64<E: Into<String>>(
        &self,
        key: &str,
        missing: impl FnOnce() -> E,
    ) -> Result<u64, String> {
        self.field(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| missing().into())
    }
}

impl Fields for Value {
    fn field(&self, key: &str) -> Option<&Value> {
        self.get(key)
    }
}

impl Fields for Map<String, Value> {
    fn field(&self, key: &str) -> Option<&Value> {
        self.get(key)
    }
}
