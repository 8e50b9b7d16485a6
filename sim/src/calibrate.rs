//! Offline calibration of `peakPrefillThroughput` against any
//! OpenAI-compatible server (`kvroute-calibrate`).
//!
//! The recipe (DESIGN §1, "Calibration"): after a warm-up, send N single
//! cold requests of exactly B prompt tokens, one at a time, each a token-ID
//! prompt (`/v1/completions`, `"prompt": [ids]`) of fresh random IDs so no
//! block is in the prefix cache, with `max_tokens: 1` and streaming on.
//! TTFT is the time from sending to the first streamed token chunk, and
//!
//! ```text
//! peakPrefillThroughput = B / median(TTFT)          tokens/s
//! τ = peakPrefillThroughput × maxTTFTPenaltyMs / 1000   tokens
//! ```
//!
//! Choose B = the server's `--max-num-batched-tokens`: the prompt is then
//! prefilled in one engine step, whose compute hides the step's fixed
//! costs; a much smaller B measures those costs, not throughput. The
//! measured TTFT also holds the network round trip and the HTTP/tokenizer
//! path (≈ 1 ms on loopback), which lowers the figure slightly; that is the
//! latency the gate's estimate stands for.

use crate::loadgen::client::HttpClient;
use kvroute_core::scheduling::Rng;
/// The arithmetic and the report are pure (`kvroute-sim-model`).
pub use kvroute_sim_model::calibrate::{median, report, spread, Calibration};
use std::time::Duration;

/// What to measure.
#[derive(Clone, Debug)]
pub struct CalibrateConfig {
    /// `http://host:port` (a trailing `/v1` or `/` is accepted).
    pub base_url: String,
    /// Served model name; `None` asks `/v1/models` for the first one.
    pub model: Option<String>,
    /// Prompt tokens per request, B.
    pub tokens: u32,
    /// Measured requests, N.
    pub requests: u32,
    /// Unmeasured requests first (compile caches, warm allocators).
    pub warmup: u32,
    /// Token IDs are drawn from `[10, token_id_max)`.
    pub token_id_max: u32,
    pub seed: u64,
    /// Per-request timeout.
    pub timeout: Duration,
    /// `maxTTFTPenaltyMs` for the printed snippet, ms.
    pub ttft_tolerance_ms: f64,
}

impl Default for CalibrateConfig {
    fn default() -> Self {
        CalibrateConfig {
            base_url: String::new(),
            model: None,
            tokens: 8192,
            requests: 10,
            warmup: 2,
            token_id_max: 4000,
            seed: 1,
            timeout: Duration::from_secs(120),
            ttft_tolerance_ms: 18_000.0,
        }
    }
}

fn root(base_url: &str) -> String {
    let u = base_url.trim_end_matches('/');
    u.strip_suffix("/v1").unwrap_or(u).to_owned()
}

async fn first_model(client: &HttpClient, root: &str) -> Result<String, String> {
    let r = client.get(&format!("{root}/v1/models")).await?;
    if r.status != 200 {
        return Err(format!(
            "{root}/v1/models answered {}; pass --model",
            r.status
        ));
    }
    let v = r.json()?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{root}/v1/models lists no model; pass --model"))
}

/// One cold request; its TTFT in seconds.
async fn one(
    client: &HttpClient,
    url: &str,
    model: &str,
    cfg: &CalibrateConfig,
    rng: &mut Rng,
) -> Result<f64, String> {
    let span = u64::from(cfg.token_id_max.saturating_sub(10).max(1));
    let ids: Vec<u64> = (0..cfg.tokens).map(|_| 10 + rng.below(span)).collect();
    let body = serde_json::json!({
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "stream": true,
        "temperature": 0,
    })
    .to_string();
    let t = client.post_timed(url, body, &[], cfg.timeout).await?;
    if t.status != 200 {
        let text = String::from_utf8_lossy(&t.body()).into_owned();
        return Err(format!("{url} answered {}: {}", t.status, text.trim()));
    }
    if let Some(e) = &t.body_error {
        return Err(format!("{url}: stream broke off: {e}"));
    }
    // The first chunk that carries a token (an SSE `data: {…}` event).
    t.chunks
        .iter()
        .find(|(_, b)| b.windows(7).any(|w| w == b"data: {"))
        .map(|(at, _)| at.as_secs_f64())
        .ok_or_else(|| format!("{url}: the stream carried no data event"))
}

/// Runs the recipe.
pub async fn run(cfg: &CalibrateConfig) -> Result<Calibration, String> {
    if cfg.tokens == 0 || cfg.requests == 0 {
        return Err("--tokens and --requests must be at least 1".into());
    }
    let client = HttpClient::new();
    let root = root(&cfg.base_url);
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => first_model(&client, &root).await?,
    };
    let url = format!("{root}/v1/completions");
    let mut rng = Rng::new(cfg.seed);
    for _ in 0..cfg.warmup {
        one(&client, &url, &model, cfg, &mut rng).await?;
    }
    let mut ttft_s = Vec::with_capacity(cfg.requests as usize);
    for _ in 0..cfg.requests {
        ttft_s.push(one(&client, &url, &model, cfg, &mut rng).await?);
    }
    let m = median(&ttft_s);
    Ok(Calibration {
        model,
        tokens: cfg.tokens,
        peak_prefill_throughput: f64::from(cfg.tokens) / m,
        ttft_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_accepts_v1_and_slashes() {
        assert_eq!(root("http://a:1/v1/"), "http://a:1");
        assert_eq!(root("http://a:1"), "http://a:1");
    }
}
