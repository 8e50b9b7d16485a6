//! A small `--flag value` parser for the two binaries, with errors that name
//! the flag and list the known ones.

use std::collections::BTreeMap;
use std::str::FromStr;

/// Parsed flags: `--name value`, `--name=value`, or a bare `--switch`.
pub struct Flags {
    values: BTreeMap<String, String>,
    program: &'static str,
}

impl Flags {
    /// Parses `args` (without the program name). `known` lists
    /// `(flag, takes_value)`; anything else is an error.
    pub fn parse(
        program: &'static str,
        args: impl IntoIterator<Item = String>,
        known: &[(&str, bool)],
    ) -> Result<Flags, String> {
        let mut values = BTreeMap::new();
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            if arg == "-h" || arg == "--help" {
                values.insert("help".into(), String::new());
                continue;
            }
            let Some(stripped) = arg.strip_prefix("--") else {
                return Err(format!(
                    "{program}: unexpected argument {arg:?}; flags start with --"
                ));
            };
            let (name, inline) = match stripped.split_once('=') {
                Some((n, v)) => (n.to_owned(), Some(v.to_owned())),
                None => (stripped.to_owned(), None),
            };
            let Some(&(_, takes_value)) = known.iter().find(|(k, _)| *k == name) else {
                let names: Vec<String> = known.iter().map(|(k, _)| format!("--{k}")).collect();
                return Err(format!(
                    "{program}: unknown flag --{name}; known flags: {}",
                    names.join(" ")
                ));
            };
            let value = if takes_value {
                match inline {
                    Some(v) => v,
                    None => it
                        .next()
                        .ok_or_else(|| format!("{program}: --{name} needs a value"))?,
                }
            } else {
                inline.unwrap_or_else(|| "true".into())
            };
            values.insert(name, value);
        }
        Ok(Flags { values, program })
    }

    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// The flag's value parsed as `T`, or `default` when absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.values.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse::<T>()
                .map_err(|e| format!("{}: --{name} {v:?} is not valid: {e}", self.program)),
        }
    }

    /// A comma-separated list.
    pub fn list<T: FromStr>(&self, name: &str) -> Result<Option<Vec<T>>, String>
    where
        T::Err: std::fmt::Display,
    {
        let Some(v) = self.values.get(name) else {
            return Ok(None);
        };
        v.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                s.trim()
                    .parse::<T>()
                    .map_err(|e| format!("{}: --{name}: {s:?} is not valid: {e}", self.program))
            })
            .collect::<Result<Vec<T>, String>>()
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn values_switches_and_lists() {
        let f = Flags::parse(
            "t",
            args("--ports 1,2 --x=3 --on"),
            &[("ports", true), ("x", true), ("on", false)],
        )
        .unwrap();
        assert_eq!(f.list::<u16>("ports").unwrap(), Some(vec![1, 2]));
        assert_eq!(f.get("x", 0u32).unwrap(), 3);
        assert!(f.has("on"));
        assert_eq!(f.get("missing", 7u32).unwrap(), 7);
    }

    #[test]
    fn errors_name_the_flag() {
        let e = Flags::parse("t", args("--nope 1"), &[("ports", true)])
            .err()
            .unwrap();
        assert!(e.contains("--nope") && e.contains("--ports"), "{e}");
        let f = Flags::parse("t", args("--x abc"), &[("x", true)]).unwrap();
        assert!(f.get("x", 0u32).unwrap_err().contains("--x"));
    }
}
