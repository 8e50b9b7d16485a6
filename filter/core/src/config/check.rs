//! What a plugin's compile function uses to read its parameters: strict
//! deserialisation (unknown fields are serde errors, with the field path),
//! range checks, and references to producer plugins. Every message names the
//! field path (`plugins[2].parameters.affinityThreshold`).

use super::ConfigError;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

pub(crate) fn err(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        message: message.into(),
    }
}

/// One plugin's parameters, as its compile function sees them.
pub(crate) struct Params<'a> {
    /// The current type name (aliases resolved).
    pub kind: &'a str,
    /// `parameters` as written (`None` when absent).
    pub value: &'a Option<Value>,
    /// `plugins[i].parameters`.
    pub path: String,
    /// Names of the `*-producer` plugins in `plugins`.
    pub producers: &'a [String],
    /// Where a compile function notes a warning ([`Params::warn`]).
    pub warnings: &'a std::cell::RefCell<Vec<String>>,
}

impl Params<'_> {
    /// The parameters as `T` (serde, unknown fields denied); absent or
    /// `null` gives `T::default()`.
    pub fn parse<T: DeserializeOwned + Default>(&self) -> Result<T, ConfigError> {
        strict_value(self.value, &self.path)
    }

    /// A plugin without parameters: anything but absent, `null` or `{}` is
    /// refused.
    pub fn none(&self) -> Result<(), ConfigError> {
        #[derive(Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct NoParams {}
        self.parse::<NoParams>().map(|_| ())
    }

    /// `plugins[i].parameters.<field>`.
    pub fn field(&self, field: &str) -> String {
        format!("{}.{field}", self.path)
    }

    /// A warning about `plugins[i].parameters.<field>`: the config loads,
    /// and `lifecycle::configure` logs it (`Config::warnings`).
    pub fn warn(&self, field: &str, message: impl AsRef<str>) {
        self.warnings
            .borrow_mut()
            .push(format!("`{}`: {}", self.field(field), message.as_ref()));
    }

    /// An error at `plugins[i].parameters.<field>`.
    pub fn err(&self, field: &str, message: impl Into<String>) -> ConfigError {
        err(self.field(field), message)
    }

    /// A `…ProducerName` field must name a producer in `plugins`.
    pub fn producer(&self, field: &str, v: &Option<String>) -> Result<(), ConfigError> {
        match v {
            Some(n) if !self.producers.iter().any(|p| p == n) => Err(self.err(
                field,
                format!("no producer plugin named \"{n}\" in `plugins`"),
            )),
            _ => Ok(()),
        }
    }
}

/// Deserialises with unknown-field rejection and a path in the error.
pub(crate) fn strict<T: DeserializeOwned>(bytes: &[u8], base: &str) -> Result<T, ConfigError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let out = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let inner = e.path().to_string();
        err(join_path(base, &inner), e.into_inner().to_string())
    })?;
    // Nothing but whitespace after the document (`from_slice` checks this;
    // a bare `Deserializer` does not).
    de.end().map_err(|e| err(base, e.to_string()))?;
    Ok(out)
}

/// Like [`strict_value`] for a section that is present.
pub(crate) fn strict_value_req<T: DeserializeOwned>(
    v: &Value,
    base: &str,
) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let inner = e.path().to_string();
        err(join_path(base, &inner), e.into_inner().to_string())
    })
}

pub(crate) fn strict_value<T: DeserializeOwned + Default>(
    v: &Option<Value>,
    base: &str,
) -> Result<T, ConfigError> {
    match v {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => serde_path_to_error::deserialize(v).map_err(|e| {
            let inner = e.path().to_string();
            err(join_path(base, &inner), e.into_inner().to_string())
        }),
    }
}

fn join_path(base: &str, inner: &str) -> String {
    match (base.is_empty(), inner == "." || inner.is_empty()) {
        (true, _) => inner.to_string(),
        (false, true) => base.to_string(),
        (false, false) => format!("{base}.{inner}"),
    }
}

pub(crate) fn range_f64(
    path: &str,
    v: Option<f64>,
    default: f64,
    lo: f64,
    hi: f64,
    what: &str,
) -> Result<f64, ConfigError> {
    let x = v.unwrap_or(default);
    if !x.is_finite() || x < lo || x > hi {
        return Err(err(path, format!("{x} is out of range: {what}")));
    }
    Ok(x)
}

pub(crate) fn range_u64(
    path: &str,
    v: Option<u64>,
    default: u64,
    lo: u64,
    hi: u64,
    unit: &str,
) -> Result<u64, ConfigError> {
    let x = v.unwrap_or(default);
    if x < lo || x > hi {
        return Err(err(
            path,
            format!("{x} is out of range: must be {lo}..={hi} {unit}"),
        ));
    }
    Ok(x)
}
