//! Every key the parser accepts, read from the raw serde structs themselves
//! (`raw`), so that the configuration reference (`docs/configuration.md`,
//! checked by `tests/docs.rs`) cannot drift from the code.
//!
//! [`accepted_keys`] drives `RawConfig`'s `Deserialize` impl with a
//! recording [`Deserializer`] that hands out no data of its own: each
//! `deserialize_struct` names its `fields`, which are recorded under the
//! path so far and then visited one by one with a placeholder value of
//! whatever type they ask for (an option is `Some`, a sequence holds one
//! element, a map one entry named `*`, an enum its first variant). A
//! maintained crate for this (serde-reflection) would add a dependency and
//! trace far more than key names; the walk below is all that is needed.
//!
//! A value whose own `Deserialize` rejects the placeholder (a custom
//! deserializer that validates a string, say) still has its key recorded,
//! since the fields of a struct are recorded before any is visited; only
//! keys below such a value would be missed, and the raw structs keep
//! validation for the `validate` step, so none has one today. An untagged
//! enum is read through `deserialize_any` and is a leaf (a value, not a
//! table).

use std::cell::RefCell;
use std::collections::BTreeSet;

use serde::de::value::{BorrowedStrDeserializer, Error};
use serde::de::{
    DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};
use serde::Deserialize;

use super::raw::RawConfig;

/// Every key the configuration file accepts, as dotted paths through its
/// tables (`proxy.listen`, `org.allow.host`, `evidence.retain_size`),
/// sorted. Tables themselves (`proxy`, `org.allow`) are not listed, only
/// the keys that hold values.
pub fn accepted_keys() -> Vec<String> {
    walk().leaves().into_iter().collect()
}

/// What one walk of `RawConfig` saw.
#[derive(Default)]
struct Walk {
    /// Every field of every struct, as a dotted path.
    fields: BTreeSet<String>,
    /// The paths whose value is a sequence (`[[org]]`, `[[org.allow]]`).
    seqs: BTreeSet<String>,
}

impl Walk {
    /// Fields that are no table of further fields.
    fn leaves(&self) -> BTreeSet<String> {
        self.fields
            .iter()
            .filter(|f| {
                let prefix = format!("{f}.");
                !self.fields.iter().any(|g| g.starts_with(&prefix))
            })
            .cloned()
            .collect()
    }
}

fn walk() -> Walk {
    let seen = RefCell::new(Walk::default());
    // An error can only come from a placeholder refused deep inside; the
    // fields recorded before it are kept (see the module doc).
    let _ = RawConfig::deserialize(Recorder {
        path: String::new(),
        seen: &seen,
    });
    seen.into_inner()
}

/// The names `serde_spanned::Spanned` deserializes through (`toml::Spanned`
/// wraps every raw value): its struct is no table of the file, its value
/// field stands at the path of the key itself.
const SPANNED: &str = "$__serde_spanned_private_Spanned";

/// A deserializer standing at one path of the file.
struct Recorder<'a> {
    path: String,
    seen: &'a RefCell<Walk>,
}

impl<'a> Recorder<'a> {
    fn at(&self, path: String) -> Self {
        Recorder {
            path,
            seen: self.seen,
        }
    }

    fn child(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }
}

/// A placeholder for every scalar a value may ask for.
macro_rules! scalars {
    ($($method:ident => $visit:ident($($value:expr)?);)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.$visit($($value)?)
        }
    )*};
}

impl<'de, 'a> Deserializer<'de> for Recorder<'a> {
    type Error = Error;

    scalars! {
        deserialize_any => visit_i64(0);
        deserialize_bool => visit_bool(false);
        deserialize_i8 => visit_i8(0);
        deserialize_i16 => visit_i16(0);
        deserialize_i32 => visit_i32(0);
        deserialize_i64 => visit_i64(0);
        deserialize_i128 => visit_i128(0);
        deserialize_u8 => visit_u8(0);
        deserialize_u16 => visit_u16(0);
        deserialize_u32 => visit_u32(0);
        deserialize_u64 => visit_u64(0);
        deserialize_u128 => visit_u128(0);
        deserialize_f32 => visit_f32(0.0);
        deserialize_f64 => visit_f64(0.0);
        deserialize_char => visit_char('x');
        deserialize_str => visit_borrowed_str("");
        deserialize_string => visit_string(String::new());
        deserialize_bytes => visit_borrowed_bytes(&[]);
        deserialize_byte_buf => visit_byte_buf(Vec::new());
        deserialize_unit => visit_unit();
        deserialize_identifier => visit_borrowed_str("");
        deserialize_ignored_any => visit_unit();
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.seen.borrow_mut().seqs.insert(self.path.clone());
        visitor.visit_seq(One { item: Some(self) })
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        // A free-form table: its keys are data, not names the parser knows.
        let fields = vec![("*", self.child("*"))];
        visitor.visit_map(Fields {
            recorder: self,
            fields: fields.into_iter(),
            value: None,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let fields: Vec<(&'static str, String)> = if name == SPANNED {
            // The span's start and end (numbers) and its value all stand
            // at the key's own path.
            fields.iter().map(|&f| (f, self.path.clone())).collect()
        } else {
            let mut seen = self.seen.borrow_mut();
            fields
                .iter()
                .map(|&f| {
                    let path = self.child(f);
                    seen.fields.insert(path.clone());
                    (f, path)
                })
                .collect()
        };
        visitor.visit_map(Fields {
            recorder: self,
            fields: fields.into_iter(),
            value: None,
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let variant = variants.first().copied().unwrap_or_default();
        visitor.visit_enum(Variant {
            recorder: self,
            variant,
        })
    }
}

/// A sequence of one element, at the sequence's own path (the keys of an
/// array of tables are named by the array: `org.name`).
struct One<'a> {
    item: Option<Recorder<'a>>,
}

impl<'de, 'a> SeqAccess<'de> for One<'a> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        match self.item.take() {
            Some(item) => seed.deserialize(item).map(Some),
            None => Ok(None),
        }
    }
}

/// The fields of one struct (or the one entry of a map), each with the path
/// its value stands at.
struct Fields<'a> {
    recorder: Recorder<'a>,
    fields: std::vec::IntoIter<(&'static str, String)>,
    value: Option<String>,
}

impl<'de, 'a> MapAccess<'de> for Fields<'a> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        match self.fields.next() {
            Some((field, path)) => {
                self.value = Some(path);
                seed.deserialize(BorrowedStrDeserializer::new(field))
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let path = self.value.take().unwrap_or_default();
        seed.deserialize(self.recorder.at(path))
    }
}

/// An enum's first variant, at the enum's path.
struct Variant<'a> {
    recorder: Recorder<'a>,
    variant: &'static str,
}

impl<'de, 'a> EnumAccess<'de> for Variant<'a> {
    type Error = Error;
    type Variant = Self;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self), Error> {
        let name = BorrowedStrDeserializer::<Error>::new(self.variant);
        let value = seed.deserialize(name)?;
        Ok((value, self))
    }
}

impl<'de, 'a> VariantAccess<'de> for Variant<'a> {
    type Error = Error;

    fn unit_variant(self) -> Result<(), Error> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, Error> {
        seed.deserialize(self.recorder)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, Error> {
        self.recorder.deserialize_seq(visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.recorder.deserialize_struct("", fields, visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::parse;
    use super::*;

    #[test]
    fn known_keys_are_listed_and_tables_are_not() {
        let keys = accepted_keys();
        for key in [
            "proxy.listen",
            "proxy.max_connections",
            "dns.upstream",
            "admin.listen",
            "evidence.retain_size",
            "intercept.ca_dir",
            "org.name",
            "org.allow.host",
            "org.allow.tunnel",
            "org.deny.cidr",
            "org.credential.secret_env",
        ] {
            assert!(keys.iter().any(|k| k == key), "{key} missing: {keys:?}");
        }
        for table in ["proxy", "org", "org.allow", "org.credential"] {
            assert!(!keys.iter().any(|k| k == table), "{table} listed");
        }
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
    }

    /// `KEY = 1` under the tables that lead to it, each as `[[T]]` where it
    /// is an array of tables, else `[T]`.
    fn setting(walk: &Walk, key: &str) -> String {
        let parts: Vec<&str> = key.split('.').collect();
        let mut src = String::new();
        for i in 1..parts.len() {
            let table = parts[..i].join(".");
            if walk.seqs.contains(&table) {
                src.push_str(&format!("[[{table}]]\n"));
            } else {
                src.push_str(&format!("[{table}]\n"));
            }
        }
        let leaf = parts.last().copied().unwrap_or_default();
        src.push_str(&format!("{leaf} = 1\n"));
        src
    }

    fn unknown(src: &str) -> Option<String> {
        let errors = parse(src).err()?;
        errors
            .0
            .iter()
            .map(|e| e.to_string())
            .find(|e| e.contains("unknown field"))
    }

    #[test]
    fn every_listed_key_is_known_to_the_parser() {
        let walk = walk();
        let keys = walk.leaves();
        assert!(keys.len() > 50, "{keys:?}");
        for key in &keys {
            // The value may be of the wrong type: only "unknown" matters.
            let src = setting(&walk, key);
            assert_eq!(unknown(&src), None, "{key}:\n{src}");
        }
        // The check can fail: a key the parser does not know is unknown.
        for bogus in ["proxy.bogus", "org.allow.bogus", "org.credential.bogus"] {
            let src = setting(&walk, bogus);
            assert!(unknown(&src).is_some(), "{bogus} not reported:\n{src}");
        }
    }
}
