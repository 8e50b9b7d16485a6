//! The arithmetic of offline calibration (`kvroute-calibrate`): the
//! measured TTFTs' spread and median, and the report with its config
//! snippets. The measurement itself (cold requests over HTTP) is
//! `kvroute_sim::calibrate`; the recipe is described there.
//!
//! ```text
//! peakPrefillThroughput = B / median(TTFT)          tokens/s
//! τ = peakPrefillThroughput × maxTTFTPenaltyMs / 1000   tokens
//! ```

/// The measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub model: String,
    pub tokens: u32,
    /// Measured TTFTs, seconds, in the order sent.
    pub ttft_s: Vec<f64>,
    /// B / median TTFT, tokens/s.
    pub peak_prefill_throughput: f64,
}

/// Spread of a sample: (min, p10, p50, p90, max), by nearest rank.
pub fn spread(values: &[f64]) -> [f64; 5] {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return [f64::NAN; 5];
    }
    let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    [v[0], rank(0.10), median(&v), rank(0.90), v[v.len() - 1]]
}

/// The median (mean of the two middle values for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The human report: value, spread, and a config snippet for the tolerance.
pub fn report(c: &Calibration, ttft_tolerance_ms: f64) -> String {
    let [min, p10, p50, p90, max] = spread(&c.ttft_s);
    let rate = |s: f64| f64::from(c.tokens) / s;
    let tps = c.peak_prefill_throughput.round();
    let tau = (tps * ttft_tolerance_ms / 1000.0).round();
    let ms = |s: f64| format!("{:.1}", s * 1000.0);
    format!(
        "model {model}, B = {b} tokens, {n} cold requests\n\
         TTFT ms: min {} p10 {} p50 {} p90 {} max {}\n\
         tokens/s: max {:.0} p90 {:.0} p50 {:.0} p10 {:.0} min {:.0} (B / each TTFT above)\n\
         peakPrefillThroughput = B / median TTFT = {tps} tokens/s\n\
         \n\
         With a TTFT tolerance of {tol} ms (maxTTFTPenaltyMs), stickiness breaks once a warm\n\
         endpoint holds τ = {tps} × {tol} / 1000 = {tau} more in-flight tokens than the least-loaded cold one.\n\
         \n\
         {{\"type\": \"prefix-cache-affinity-filter\", \"parameters\": {{\"maxTTFTPenaltyMs\": {tol}, \"peakPrefillThroughput\": {tps}}}}}\n\
         \n\
         or, to let the collector keep it current per endpoint from vLLM's metrics:\n\
         \n\
         {{\"type\": \"prefix-cache-affinity-filter\", \"parameters\": {{\"maxTTFTPenaltyMs\": {tol}, \"peakPrefillThroughput\": {{\"auto\": true, \"initial\": {tps}}}}}}}\n",
        ms(min),
        ms(p10),
        ms(p50),
        ms(p90),
        ms(max),
        rate(min),
        rate(p10),
        rate(p50),
        rate(p90),
        rate(max),
        model = c.model,
        b = c.tokens,
        n = c.ttft_s.len(),
        tol = ttft_tolerance_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_median() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(spread(&v), [1.0, 1.0, 3.0, 5.0, 5.0]);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(spread(&ten), [1.0, 1.0, 5.5, 9.0, 10.0]);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn report_has_value_tau_and_both_snippets() {
        let c = Calibration {
            model: "m".into(),
            tokens: 8192,
            ttft_s: vec![0.4, 0.41, 0.39],
            peak_prefill_throughput: 20_480.0,
        };
        let r = report(&c, 2000.0);
        assert!(r.contains("= 20480 tokens/s"), "{r}");
        assert!(r.contains("= 40960 more in-flight tokens"), "{r}");
        assert!(
            r.contains(r#""maxTTFTPenaltyMs": 2000, "peakPrefillThroughput": 20480}"#),
            "{r}"
        );
        assert!(r.contains(r#"{"auto": true, "initial": 20480}"#), "{r}");
        // Each snippet is valid JSON.
        for line in r.lines().filter(|l| l.starts_with('{')) {
            serde_json::from_str::<serde_json::Value>(line).unwrap();
        }
    }
}
