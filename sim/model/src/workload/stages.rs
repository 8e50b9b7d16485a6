//! Load stages: Poisson arrival rates, fixed concurrencies and sessions.
//!
//! Grammar: `SPEC[;SPEC…]`, where SPEC is `rate:R1,R2,…@DURATION` (a Poisson
//! stage per rate, requests/s), `concurrency:C1,C2,…@DURATION` (a closed
//! loop of C clients per stage) or `sessions:N@SPREAD,think=THINK` (N
//! conversations of a multi-turn workload, one client each, starting
//! uniformly over SPREAD; each sends all its turns, waiting an exponential
//! think time of mean THINK after each answer; the stage lasts until the
//! last turn ends; the fleet simulator only). DURATION, SPREAD and THINK are
//! `20s`, `500ms`, `2m` or plain seconds. Rates and durations are in model
//! time; the load generator's `--time-scale` converts them to wall-clock
//! time.

#[derive(Clone, Debug, PartialEq)]
pub enum StageKind {
    /// Poisson arrivals at this many requests per second.
    Rate(f64),
    /// This many clients, each sending its next request when the last ends.
    Concurrency(u32),
    /// This many conversations, each its own closed-loop client: it starts
    /// at a uniform time in the stage's duration, sends its turns in order
    /// and waits an exponential think time (mean `think_s`, model s) after
    /// each answer.
    Sessions { clients: u32, think_s: f64 },
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
            StageKind::Sessions { clients, think_s } => {
                format!(
                    "sessions {clients} think {think_s}s over {}s",
                    self.duration_s
                )
            }
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
        let (dur, think) = match dur.split_once(',') {
            Some((d, t)) => (d, Some(t.trim())),
            None => (dur, None),
        };
        let duration_s = parse_duration(dur)?;
        let (kind, values) = head
            .split_once(':')
            .ok_or_else(|| format!("stage {part:?} is not rate:… or concurrency:…"))?;
        let think_s = match (kind.trim(), think) {
            ("sessions", Some(t)) => match t.strip_prefix("think=") {
                Some(t) => parse_duration(t)?,
                None => return Err(format!("stage {part:?}: {t:?} is not think=DURATION")),
            },
            ("sessions", None) => {
                return Err(format!(
                    "stage {part:?} has no think time (e.g. sessions:32@20s,think=4s)"
                ))
            }
            (_, Some(t)) => return Err(format!("stage {part:?}: {t:?} is for sessions stages")),
            (_, None) => 0.0,
        };
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
                "sessions" => {
                    let clients: u32 = v
                        .parse()
                        .map_err(|_| format!("sessions {v:?} is not a whole number"))?;
                    if clients == 0 {
                        return Err("sessions must be at least 1".into());
                    }
                    StageKind::Sessions { clients, think_s }
                }
                other => {
                    return Err(format!(
                        "stage kind {other:?} is not rate, concurrency or sessions"
                    ))
                }
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
        assert!(parse_stages("sessions:4@20s")
            .unwrap_err()
            .contains("think"));
        assert!(parse_stages("sessions:4@20s,4s")
            .unwrap_err()
            .contains("think="));
        assert!(parse_stages("rate:2@20s,think=4s")
            .unwrap_err()
            .contains("sessions"));
        assert!(parse_stages("sessions:0@20s,think=1s").is_err());
    }

    #[test]
    fn parses_sessions_with_their_think_time() {
        let s = parse_stages("sessions:32@20s,think=4s;rate:1@5s").unwrap();
        assert_eq!(
            s[0],
            Stage {
                kind: StageKind::Sessions {
                    clients: 32,
                    think_s: 4.0
                },
                duration_s: 20.0
            }
        );
        assert_eq!(s[1].kind, StageKind::Rate(1.0));
        assert_eq!(
            parse_stages("sessions:2@1m,think=500ms").unwrap()[0].kind,
            StageKind::Sessions {
                clients: 2,
                think_s: 0.5
            }
        );
    }
}
