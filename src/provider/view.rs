//! Borrowed, typed views of provider bodies (issue 13 item 6): what an adapter reads of a
//! body, deserialized straight from its bytes, strings borrowed where they need no unescaping,
//! every other field skipped. A view is an optimization of a reader over the JSON tree, never
//! a second reading: it accepts only bodies in which every field it reads has the type the
//! tree reader expects there (an object where an object is read, a string where a string is,
//! no field twice), and the caller reads the tree for any other body. So where a view answers,
//! the tree reader would have answered the same (checked against it in
//! `tests/it/fuzz.rs`, `a_typed_view_reads_what_the_tree_reader_reads`).
//!
//! A view skips the fields it does not read by syntax alone (`serde::de::IgnoredAny`), which
//! does not check number ranges the way a tree does: a view reads a body only after
//! [`crate::strict_json::is_readable_object`] found it to be one object a tree can be read
//! from (DESIGN.md §9: nothing passes that turnguard could not read).

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

/// A JSON object read as `T`. serde's derived structs also accept a JSON array (their fields
/// by position), which a tree reader never reads as an object: this accepts objects only.
#[derive(Debug)]
pub struct Obj<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Only<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for Only<T> {
            type Value = T;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }

        d.deserialize_map(Only(PhantomData)).map(Obj)
    }
}

/// For `#[serde(default, deserialize_with = "view::present")]` on an `Option<Option<T>>`
/// field: `None` when the field is missing, `Some(None)` when it is `null`, `Some(Some(_))`
/// otherwise. serde reads a `null` `Option<T>` as a missing one; a reader that tells them
/// apart (Chat's `arguments: null` is the text `null`) needs this.
pub fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// A JSON string, borrowed from the body when it has no escapes (a `Cow<str>` field is
/// always copied by serde's derive).
#[derive(Debug)]
pub struct Str<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Text<'a> {
            type Value = Str<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON string")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E>(self, v: String) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }

        d.deserialize_str(Text(PhantomData))
    }
}

impl Str<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, owned (a copy only when it is borrowed).
    pub fn into_owned(self) -> String {
        self.0.into_owned()
    }
}
