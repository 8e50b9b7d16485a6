//! Prometheus text exposition, written the way vLLM's Python client writes
//! it and read back by name and labels.
//!
//! Writer rules copied from what the vLLM 0.32 captures show:
//! - labels are sorted by name (`{engine="0",le="0.1",model_name="tiny"}`);
//! - values use Python's float repr, with the client's switch to an
//!   exponent once the integer part has 7 or more digits
//!   (`25197.0`, `0.5170741081237793`, `1.7959421408367665e+09`).
//!
//! The parser takes any exposition text (vLLM's or ours): it skips comments,
//! reads `name{label="value",…} value [timestamp]`, unescapes label values,
//! and reports the first malformed line with its number.

use std::fmt::Write as _;

/// Formats a value like `prometheus_client`'s `floatToGoString`.
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let s = python_repr(v);
    if v > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 && !s.contains('e') {
                let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
                let mantissa = format!("{}.{}", &s[..1], digits);
                let mantissa = mantissa.trim_end_matches(['0', '.']);
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    s
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integers,
/// exponent form below 1e-4 and from 1e16.
fn python_repr(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let e = format!("{v:e}"); // like "1.5e-5" or "1e16"
        let (m, exp) = e.split_once('e').unwrap_or((&e, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{m}e{sign}{:02}", exp.abs());
    }
    let s = format!("{v}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// Builds an exposition text.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    /// `# HELP` and `# TYPE` lines of a metric family.
    pub fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample; labels are written sorted by name.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let mut labels = labels.to_vec();
        labels.sort_by(|a, b| a.0.cmp(b.0));
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let v = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(self.out, "{k}=\"{v}\"");
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_value(value));
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// One parsed sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses exposition text into samples.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).map_err(|e| format!("line {}: {e}: {line:?}", n + 1))?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err("bad metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut pos = 0; // byte offset into r
        loop {
            pos += r[pos..].len() - r[pos..].trim_start_matches([',', ' ']).len();
            let tail = &r[pos..];
            if tail.is_empty() {
                return Err("unterminated labels".into());
            }
            if let Some(after) = tail.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = tail.find('=').ok_or("label without '='")?;
            let key = tail[..eq].trim().to_owned();
            let body = tail[eq + 1..]
                .strip_prefix('"')
                .ok_or("label value not quoted")?;
            let mut value = String::new();
            let mut end = None;
            let mut esc = false;
            for (i, ch) in body.char_indices() {
                if esc {
                    value.push(if ch == 'n' { '\n' } else { ch });
                    esc = false;
                } else if ch == '\\' {
                    esc = true;
                } else if ch == '"' {
                    end = Some(i);
                    break;
                } else {
                    value.push(ch);
                }
            }
            let end = end.ok_or("unterminated label value")?;
            labels.push((key, value));
            // key '=' '"' value '"'
            pos += eq + 2 + end + 1;
        }
    }
    let value_str = rest.split_whitespace().next().ok_or("no value")?;
    let value = match value_str {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().map_err(|_| format!("bad value {v:?}"))?,
    };
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The value of the first sample named `name` whose labels include all of
/// `labels`.
pub fn find(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
        .map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_format_like_the_python_client() {
        assert_eq!(format_value(25197.0), "25197.0");
        assert_eq!(format_value(0.0), "0.0");
        assert_eq!(format_value(0.5170741081237793), "0.5170741081237793");
        assert_eq!(format_value(1.7959421408367665e9), "1.7959421408367665e+09");
        assert_eq!(format_value(4.85963776e9), "4.85963776e+09");
        assert_eq!(format_value(1_000_000.0), "1e+06");
        assert_eq!(format_value(999_999.0), "999999.0");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(2.5e-5), "2.5e-05");
    }

    #[test]
    fn labels_are_sorted_and_escaped_and_parse_back() {
        let mut e = Exposition::new();
        e.sample(
            "x:y",
            &[("model_name", "m\"1"), ("le", "0.1"), ("engine", "0")],
            3.0,
        );
        let text = e.finish();
        assert_eq!(
            text,
            "x:y{engine=\"0\",le=\"0.1\",model_name=\"m\\\"1\"} 3.0\n"
        );
        let s = parse(&text).unwrap();
        assert_eq!(s[0].label("model_name"), Some("m\"1"));
        assert_eq!(find(&s, "x:y", &[("le", "0.1")]), Some(3.0));
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let err = parse("# ok\nfoo 1\nbar{a=\"b\" 2\n").unwrap_err();
        assert!(err.starts_with("line 3"), "{err}");
        assert!(parse("foo notanumber").is_err());
    }
}
