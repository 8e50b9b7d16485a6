//! Load stages: Poisson arrival rates and fixed concurrencies.
//!
//! Grammar: `SPEC[;SPEC…]`, where SPEC is `rate:R1,R2,…@DURATION` (a Poisson
//! stage per rate, requests/s) or `concurrency:C1,C2,…@DURATION` (a closed
//! loop of C clients per stage). DURATION is `20s`, `500ms`, `2m` or plain
//! seconds. Rates and durations are in model time; the load generator's
//! `--time-scale` converts them to wall-clock time.

#[derive(Clone, Debug, PartialEq)]
pub enum StageKind {
    /// Poisson arrivals at this many requests per second.
    Rate(f64),
    /// This many clients, each sending its next request when the last ends.
    Concurrency(u32),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub kind: StageKind,
    /// Model seconds.
    pub duration_s: f64,
}

impl Stage {
    pub fn label(&self) -> String {
        match self.kind {
            StageKind::Rate(r) => format!("rate {r}/s {}s", self.duration_s),
            StageKind::Concurrency(c) => format!("conc {c} {}s", self.duration_s),
        }
    }
}

fn parse_duration(s: &str) -> Result<f64, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("duration {s:?} is not like 20s, 500ms or 2m"))?;
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("duration {s:?} must be positive"));
    }
    Ok(v * mult)
}

/// Parses a stage list, e.g. `rate:3,10,30@20s;concurrency:4@30s`.
pub fn parse_stages(spec: &str) -> Result<Vec<Stage>, String> {
    let mut out = Vec::new();
    for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (head, dur) = part
            .split_once('@')
            .ok_or_else(|| format!("stage {part:?} has no @DURATION (e.g. rate:3,10@20s)"))?;
        let duration_s = parse_duration(dur)?;
        let (kind, values) = head
            .split_once(':')
            .ok_or_else(|| format!("stage {part:?} is not rate:… or concurrency:…"))?;
        for v in values.split(',').map(str::trim).filter(|v| !v.is_empty()) {
            let kind = match kind.trim() {
                "rate" => {
                    let r: f64 = v
                        .parse()
                        .map_err(|_| format!("rate {v:?} is not a number"))?;
                    if !(r > 0.0 && r.is_finite()) {
                        return Err(format!("rate {v:?} must be positive"));
                    }
                    StageKind::Rate(r)
                }
                "concurrency" => {
                    let c: u32 = v
                        .parse()
                        .map_err(|_| format!("concurrency {v:?} is not a whole number"))?;
                    if c == 0 {
                        return Err("concurrency must be at least 1".into());
                    }
                    StageKind::Concurrency(c)
                }
                other => return Err(format!("stage kind {other:?} is not rate or concurrency")),
            };
            out.push(Stage { kind, duration_s });
        }
    }
    if out.is_empty() {
        return Err("no stages given (e.g. --stages rate:3,10@20s)".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ramps_and_mixes() {
        let s = parse_stages("rate:3,10,30@20s;concurrency:4@500ms").unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(
            s[0],
            Stage {
                kind: StageKind::Rate(3.0),
                duration_s: 20.0
            }
        );
        assert_eq!(s[2].kind, StageKind::Rate(30.0));
        assert_eq!(
            s[3],
            Stage {
                kind: StageKind::Concurrency(4),
                duration_s: 0.5
            }
        );
        assert_eq!(parse_stages("rate:1@2m").unwrap()[0].duration_s, 120.0);
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert!(parse_stages("rate:3").unwrap_err().contains("@DURATION"));
        assert!(parse_stages("burst:3@1s").unwrap_err().contains("burst"));
        assert!(parse_stages("rate:-1@1s").unwrap_err().contains("positive"));
        assert!(parse_stages("rate:1@soon")
            .unwrap_err()
            .contains("duration"));
        assert!(parse_stages("").is_err());
    }
}
