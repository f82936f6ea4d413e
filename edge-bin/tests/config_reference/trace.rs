//! The file format a `Deserialize` impl accepts, read off the impl itself.
//!
//! [`Tracer`] is a serde `Deserializer` that answers every request of the
//! impl with a placeholder value and writes down what was asked: a struct's
//! field names (serde's own list, renames applied), an `Option`, a sequence
//! and its element, a map and its value, a primitive. The serde mirrors of
//! `edge.toml` and `node.toml` (`deny_unknown_fields`) are exactly the keys
//! the binaries accept, so their trace is the key list the reference page
//! must match.
//!
//! Why not `serde-reflection`: it refuses `deserialize_any`, which both
//! files use (`#[serde(untagged)]` for a client key's `priority`, a
//! one-or-many string list for the Node's `edge_addr`), and its walk stops at
//! the first refusal. Here such a value is [`Shape::Any`]: its key is listed,
//! its type is the page's to state.

use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};

/// What one value of the file is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    Bool,
    Integer,
    Float,
    String,
    /// `Option<T>`: the key may be left out.
    Optional(Box<Shape>),
    Array(Box<Shape>),
    /// A struct: its keys in declaration order.
    Table(Vec<(&'static str, Shape)>),
    /// A map with free keys (the Node's `allowed_origins`: slot → origins).
    Map(Box<Shape>),
    /// Read with `deserialize_any`: the value's own type decides.
    Any,
    /// Not asked for (yet).
    Unknown,
}

impl Shape {
    /// Without its `Option`.
    fn bare(&self) -> &Shape {
        match self {
            Shape::Optional(inner) => inner.bare(),
            other => other,
        }
    }

    /// How the page names the type; `None` for [`Shape::Any`] (the page
    /// states it, unchecked).
    pub fn type_name(&self) -> Option<String> {
        let name = match self.bare() {
            Shape::Bool => "boolean".to_owned(),
            Shape::Integer => "integer".to_owned(),
            Shape::Float => "float".to_owned(),
            Shape::String => "string".to_owned(),
            Shape::Table(_) | Shape::Map(_) => "table".to_owned(),
            Shape::Array(element) => format!("array of {}s", element.type_name()?),
            Shape::Any | Shape::Unknown => return None,
            Shape::Optional(_) => unreachable!("bare() strips options"),
        };
        Some(name)
    }

    pub fn is_integer(&self) -> bool {
        *self.bare() == Shape::Integer
    }
}

/// One key of the file: its dotted path (`nodes.adapters.capacity`; a map's
/// free key is `<name>`) and its shape.
#[derive(Debug, Clone)]
pub struct Key {
    pub path: String,
    pub shape: Shape,
}

/// The shape of what `deserialize` accepts (a `deserialize_file_format`
/// hook); panics with serde's message when the walk fails.
pub fn trace(deserialize: impl FnOnce(Tracer<'_>) -> Result<(), TraceError>) -> Shape {
    let mut shape = Shape::Unknown;
    if let Err(e) = deserialize(Tracer { out: &mut shape }) {
        panic!("tracing the file format failed: {e}");
    }
    shape
}

/// Every key of a traced file, tables and arrays of tables included, parents
/// before their children.
pub fn keys(file: &Shape) -> Vec<Key> {
    let mut out = Vec::new();
    children(file, "", &mut out);
    out
}

fn children(shape: &Shape, prefix: &str, out: &mut Vec<Key>) {
    match shape.bare() {
        Shape::Table(fields) => {
            for (name, field) in fields {
                let path = format!("{prefix}{name}");
                out.push(Key {
                    path: path.clone(),
                    shape: field.clone(),
                });
                children(field, &format!("{path}."), out);
            }
        }
        Shape::Array(element) => children(element, prefix, out),
        Shape::Map(value) => {
            let path = format!("{prefix}<name>");
            out.push(Key {
                path: path.clone(),
                shape: (**value).clone(),
            });
            children(value, &format!("{path}."), out);
        }
        _ => {}
    }
}

/// Why a walk failed: the impl refused a placeholder, or asked for
/// something this tracer does not model (then the file format grew a kind
/// of value the page's test must learn first).
#[derive(Debug)]
pub struct TraceError(String);

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TraceError {}

impl de::Error for TraceError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        TraceError(msg.to_string())
    }
}

fn unsupported(what: &str) -> TraceError {
    TraceError(format!("the config tracer does not model {what}"))
}

/// Records into `out` what the impl asks of it.
#[derive(Debug)]
pub struct Tracer<'a> {
    out: &'a mut Shape,
}

macro_rules! primitive {
    ($($method:ident => $shape:ident, $visit:ident($value:expr);)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
                *self.out = Shape::$shape;
                visitor.$visit($value)
            }
        )*
    };
}

macro_rules! refused {
    ($($method:ident($($arg:ty),*);)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, $(_: $arg,)* _: V) -> Result<V::Value, TraceError> {
                Err(unsupported(stringify!($method)))
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for Tracer<'_> {
    type Error = TraceError;

    primitive! {
        deserialize_bool => Bool, visit_bool(false);
        deserialize_i8 => Integer, visit_i8(0);
        deserialize_i16 => Integer, visit_i16(0);
        deserialize_i32 => Integer, visit_i32(0);
        deserialize_i64 => Integer, visit_i64(0);
        deserialize_i128 => Integer, visit_i128(0);
        deserialize_u8 => Integer, visit_u8(0);
        deserialize_u16 => Integer, visit_u16(0);
        deserialize_u32 => Integer, visit_u32(0);
        deserialize_u64 => Integer, visit_u64(0);
        deserialize_u128 => Integer, visit_u128(0);
        deserialize_f32 => Float, visit_f32(0.0);
        deserialize_f64 => Float, visit_f64(0.0);
        deserialize_char => String, visit_char('x');
        deserialize_str => String, visit_str("");
        deserialize_string => String, visit_str("");
        // One-or-many lists and untagged enums: any value will do; a
        // string is one every such impl here takes.
        deserialize_any => Any, visit_str("");
    }

    refused! {
        deserialize_bytes();
        deserialize_byte_buf();
        deserialize_unit();
        deserialize_unit_struct(&'static str);
        deserialize_tuple(usize);
        deserialize_tuple_struct(&'static str, usize);
        deserialize_identifier();
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        let mut inner = Shape::Unknown;
        let value = visitor.visit_some(Tracer { out: &mut inner })?;
        *self.out = Shape::Optional(Box::new(inner));
        Ok(value)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        let mut element = Shape::Unknown;
        let value = visitor.visit_seq(OneElement {
            out: Some(&mut element),
        })?;
        *self.out = Shape::Array(Box::new(element));
        Ok(value)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        let mut key = Shape::Unknown;
        let mut value_shape = Shape::Unknown;
        let value = visitor.visit_map(OneEntry {
            key: Some(&mut key),
            value: Some(&mut value_shape),
        })?;
        if key != Shape::String {
            return Err(unsupported(&format!("a map whose keys are {key:?}")));
        }
        *self.out = Shape::Map(Box::new(value_shape));
        Ok(value)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        let mut shapes: Vec<(&'static str, Shape)> =
            fields.iter().map(|f| (*f, Shape::Unknown)).collect();
        let value = visitor.visit_map(Fields {
            fields: &mut shapes,
            next: 0,
        })?;
        *self.out = Shape::Table(shapes);
        Ok(value)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        // A plain enum is written as one of its variant names.
        let Some(first) = variants.first() else {
            return Err(unsupported("an enum without variants"));
        };
        *self.out = Shape::String;
        visitor.visit_enum(IntoDeserializer::<TraceError>::into_deserializer(*first))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        visitor.visit_unit()
    }
}

/// A struct's fields, each key once, each value traced into its slot.
struct Fields<'a> {
    fields: &'a mut [(&'static str, Shape)],
    next: usize,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = TraceError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, TraceError> {
        let Some((name, _)) = self.fields.get(self.next) else {
            return Ok(None);
        };
        seed.deserialize(IntoDeserializer::<TraceError>::into_deserializer(*name))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, TraceError> {
        let Some((_, shape)) = self.fields.get_mut(self.next) else {
            return Err(unsupported("a value without its key"));
        };
        self.next += 1;
        seed.deserialize(Tracer { out: shape })
    }
}

/// A sequence of one element.
struct OneElement<'a> {
    out: Option<&'a mut Shape>,
}

impl<'de> SeqAccess<'de> for OneElement<'_> {
    type Error = TraceError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, TraceError> {
        match self.out.take() {
            None => Ok(None),
            Some(out) => seed.deserialize(Tracer { out }).map(Some),
        }
    }
}

/// A map of one entry.
struct OneEntry<'a> {
    key: Option<&'a mut Shape>,
    value: Option<&'a mut Shape>,
}

impl<'de> MapAccess<'de> for OneEntry<'_> {
    type Error = TraceError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, TraceError> {
        match self.key.take() {
            None => Ok(None),
            Some(out) => seed.deserialize(Tracer { out }).map(Some),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, TraceError> {
        match self.value.take() {
            None => Err(unsupported("a map value without its key")),
            Some(out) => seed.deserialize(Tracer { out }),
        }
    }
}
