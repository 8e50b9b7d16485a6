//! How an emulated server turns a text or chat prompt into tokens.
//!
//! vLLM renders a chat request with the model's chat template and tokenizes
//! the text with the model's tokenizer; a completions prompt is tokenized as
//! given. The emulator does the same with a real `tokenizer.json`
//! ([`Tokenization::Model`], the default: the tiny byte-level BPE of the
//! real-vLLM tier, `testdata/tokenizer/tiny-bpe-4096`, compiled in), so its
//! token counts and block boundaries are the model's, not kvroute's
//! bytes-per-token estimate. [`Tokenization::Estimate`]
//! (`--tokenizer estimate`) keeps the older stand-in, `bytes /
//! chars_per_token`, for tests that want the router's estimate to be exact.
//!
//! Rendering and tokenizing use `kvroute_core::precise::tokenizer`, the code
//! that mirrors vLLM for precise mode, and that the real-vLLM tier checks
//! token for token against a real server (`tests/real/test_hash_parity.py`).
//! The router's *guesses* (its bytes-per-token estimate, its block size, its
//! rendered stand-in for chat) are not used here.
//!
//! **Speed.** A byte-level BPE tokenizes about 1 MB/s, so a 30 KB prompt
//! would cost 30 ms per request, too slow for a fleet at 100 requests/s of
//! wall time. Text is therefore tokenized line by line, with a bounded cache
//! of each line's tokens. This is exact when the tokenizer's pre-tokenizer
//! always ends a pre-token after a newline that is followed by a
//! non-whitespace character (true of GPT-2-style byte-level regexes), and
//! the post-processor adds nothing inside the text. [`PromptTokenizer::new`]
//! checks this on a sample text and tokenizes whole texts, uncached, when it
//! does not hold.

use kvroute_core::precise::tokenizer::{ModelTokenizer, TokenizeError};
use kvroute_core::request::ApiKind;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The compiled-in default tokenizer (see the module doc).
const TINY_TOKENIZER: &[u8] =
    include_bytes!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer.json");
const TINY_CONFIG: &str =
    include_str!("../../../../testdata/tokenizer/tiny-bpe-4096/tokenizer_config.json");

/// Bytes of line text the cache holds before it is emptied.
const CACHE_BYTES: usize = 64 << 20;

/// How text prompts become tokens.
#[derive(Clone, Debug)]
pub enum Tokenization {
    /// `bytes / chars_per_token` tokens, kvroute's own estimate.
    Estimate,
    /// A real tokenizer and chat template.
    Model(Arc<PromptTokenizer>),
}

impl Tokenization {
    /// The compiled-in tiny BPE (loaded once per process).
    pub fn tiny() -> Tokenization {
        static TINY: OnceLock<Arc<PromptTokenizer>> = OnceLock::new();
        Tokenization::Model(
            TINY.get_or_init(|| {
                let cfg = serde_json::from_str(TINY_CONFIG).ok();
                Arc::new(
                    PromptTokenizer::new(TINY_TOKENIZER, cfg.as_ref())
                        .expect("the compiled-in tokenizer loads"),
                )
            })
            .clone(),
        )
    }

    /// `--tokenizer`: `tiny`, `estimate`, a `tokenizer.json` file, or a
    /// directory holding `tokenizer.json` and, optionally,
    /// `tokenizer_config.json` (for the chat template and special tokens).
    pub fn from_arg(arg: &str) -> Result<Tokenization, String> {
        match arg {
            "tiny" => return Ok(Tokenization::tiny()),
            "estimate" => return Ok(Tokenization::Estimate),
            _ => {}
        }
        let path = std::path::Path::new(arg);
        let (json, cfg_path) = if path.is_dir() {
            (
                path.join("tokenizer.json"),
                Some(path.join("tokenizer_config.json")),
            )
        } else {
            (
                path.to_path_buf(),
                path.parent().map(|p| p.join("tokenizer_config.json")),
            )
        };
        let bytes = std::fs::read(&json)
            .map_err(|e| format!("--tokenizer: cannot read {}: {e}", json.display()))?;
        let cfg = match cfg_path.filter(|p| p.is_file()) {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| format!("--tokenizer: cannot read {}: {e}", p.display()))?;
                Some(
                    serde_json::from_str(&text)
                        .map_err(|e| format!("--tokenizer: {}: {e}", p.display()))?,
                )
            }
        };
        Ok(Tokenization::Model(Arc::new(PromptTokenizer::new(
            &bytes,
            cfg.as_ref(),
        )?)))
    }
}

/// A model tokenizer with a line cache.
pub struct PromptTokenizer {
    model: ModelTokenizer,
    /// Line-by-line tokenization equals whole-text tokenization.
    by_line: bool,
    cache: Mutex<LineCache>,
}

#[derive(Default)]
struct LineCache {
    lines: HashMap<Box<str>, Arc<[u32]>>,
    bytes: usize,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("by_line", &self.by_line)
            .finish_non_exhaustive()
    }
}

/// A sample with the shapes prompts have: words, punctuation, numbers,
/// blank lines, indentation and chat-template markers.
const SAMPLE: &str = "<s>system: You are a helpful assistant.\nRead the file below.\n\n  fn main() {\n\tlet x = 42;\n}\n<s>user: what is 3.14 * 2?\nIt's   fine, isn't it?\n\n\nok\n<s>assistant: ";

impl PromptTokenizer {
    /// Loads a `tokenizer.json` and its optional `tokenizer_config.json`.
    pub fn new(
        tokenizer_json: &[u8],
        tokenizer_config: Option<&serde_json::Value>,
    ) -> Result<PromptTokenizer, String> {
        let model = ModelTokenizer::load(tokenizer_json, tokenizer_config, None)?;
        let mut t = PromptTokenizer {
            model,
            by_line: false,
            cache: Mutex::new(LineCache::default()),
        };
        let whole = |add| t.model.encode(SAMPLE, add).map_err(why);
        let (w0, w1) = (whole(false)?, whole(true)?);
        t.by_line = true;
        let lined = |add| t.encode(SAMPLE, add);
        t.by_line = lined(false).as_deref() == Ok(&w0[..]) && lined(true).as_deref() == Ok(&w1[..]);
        if let Ok(mut c) = t.cache.lock() {
            *c = LineCache::default();
        }
        Ok(t)
    }

    /// Whether text is tokenized line by line (see the module doc).
    pub fn by_line(&self) -> bool {
        self.by_line
    }

    /// The prompt's token IDs as vLLM computes them: chat bodies through the
    /// chat template, completions prompts (`text`) as given. Other APIs
    /// (Responses) are not modelled and get `None`.
    pub fn prompt_ids(
        &self,
        kind: ApiKind,
        body: &[u8],
        text: &str,
    ) -> Option<Result<Vec<u32>, String>> {
        match kind {
            ApiKind::ChatCompletions => Some(
                self.model
                    .render_chat(body)
                    .map_err(why)
                    .and_then(|(text, add): (String, bool)| self.encode(&text, add)),
            ),
            ApiKind::Completions => {
                let add = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("add_special_tokens").and_then(|b| b.as_bool()))
                    .unwrap_or(true);
                Some(self.encode(text, add))
            }
            // Generate prompts are token IDs (never text).
            ApiKind::Responses | ApiKind::Embeddings | ApiKind::Messages | ApiKind::Generate => {
                None
            }
        }
    }

    /// Token IDs of `text`, line by line through the cache when exact.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        if !self.by_line {
            return self.model.encode(text, add_special_tokens).map_err(why);
        }
        let mut out = Vec::with_capacity(text.len() / 2);
        for (i, line) in lines(text).enumerate() {
            // Special tokens a post-processor adds go around the whole text;
            // the check in `new` proves the first line carries them.
            let add = add_special_tokens && i == 0;
            if add {
                out.extend(self.model.encode(line, true).map_err(why)?);
                continue;
            }
            let hit = self
                .cache
                .lock()
                .ok()
                .and_then(|c| c.lines.get(line).cloned());
            let ids = match hit {
                Some(ids) => ids,
                None => {
                    let ids: Arc<[u32]> = self.model.encode(line, false).map_err(why)?.into();
                    if let Ok(mut c) = self.cache.lock() {
                        if c.bytes + line.len() > CACHE_BYTES {
                            *c = LineCache::default();
                        }
                        c.bytes += line.len();
                        c.lines.insert(line.into(), ids.clone());
                    }
                    ids
                }
            };
            out.extend_from_slice(&ids);
        }
        Ok(out)
    }
}

/// vLLM's 400 message for a prompt it cannot tokenize.
fn why(e: TokenizeError) -> String {
    match e {
        TokenizeError::Template(m) => format!("chat template: {m}"),
        TokenizeError::Tokenize(m) => format!("tokenizer: {m}"),
        TokenizeError::Unsupported(what) => format!("not supported by the emulator: {what}"),
    }
}

/// Splits after each `\n` that is followed by a non-whitespace character;
/// the pieces concatenate to `text`.
fn lines(text: &str) -> impl Iterator<Item = &str> {
    let b = text.as_bytes();
    let mut start = 0;
    let mut i = 0;
    std::iter::from_fn(move || {
        if start >= b.len() {
            return None;
        }
        while i < b.len() {
            i += 1;
            if b[i - 1] == b'\n' && i < b.len() && !b[i].is_ascii_whitespace() {
                let piece = &text[start..i];
                start = i;
                return Some(piece);
            }
        }
        let piece = &text[start..];
        start = b.len();
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_after_newlines_before_non_space_and_rejoin() {
        let t = "a\nb\n\nc\n d\n";
        let v: Vec<&str> = lines(t).collect();
        assert_eq!(v, ["a\n", "b\n\n", "c\n d\n"]);
        assert_eq!(v.concat(), t);
        assert_eq!(lines("").count(), 0);
        assert_eq!(lines("no newline").collect::<Vec<_>>(), ["no newline"]);
    }

    #[test]
    fn line_by_line_equals_whole_text_on_workload_prompts() {
        let Tokenization::Model(t) = Tokenization::tiny() else {
            unreachable!()
        };
        assert!(t.by_line(), "the tiny BPE splits at newlines");
        let mut rng = kvroute_core::scheduling::Rng::derive(7, 1);
        let mut text = String::new();
        for i in 0..40 {
            text.push_str(&crate::words::text_of_bytes(200 + i * 37, &mut rng));
            text.push_str(["\n", "\n\n", "\n  ", ". \n"][i % 4]);
        }
        for add in [false, true] {
            let whole = t.model.encode(&text, add).unwrap();
            // Twice: the second pass is served from the cache.
            assert_eq!(t.encode(&text, add).unwrap(), whole);
            assert_eq!(t.encode(&text, add).unwrap(), whole);
        }
    }

    #[test]
    fn chat_prompts_go_through_the_template_and_count_real_tokens() {
        let Tokenization::Model(t) = Tokenization::tiny() else {
            unreachable!()
        };
        let content = "the quick brown fox jumps over the lazy dog ".repeat(20);
        let body = serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
        let body = serde_json::to_vec(&body).unwrap();
        let ids = t
            .prompt_ids(ApiKind::ChatCompletions, &body, "")
            .unwrap()
            .unwrap();
        let rendered = format!("<s>user: {content}\n<s>assistant: ");
        assert_eq!(ids, t.model.encode(&rendered, false).unwrap());
        // Real tokens, not bytes / 4: this text is ~2-5 bytes per token.
        let bpt = rendered.len() as f64 / ids.len() as f64;
        assert!(bpt > 1.5 && bpt < 6.0, "{bpt}");
        assert_ne!(ids.len(), rendered.len() / 4);
        assert!(t.prompt_ids(ApiKind::Responses, &body, "").is_none());
    }

    #[test]
    fn a_bad_tokenizer_path_is_a_clear_error() {
        let e = Tokenization::from_arg("/nonexistent/tokenizer.json").unwrap_err();
        assert!(e.contains("cannot read"), "{e}");
        assert!(matches!(
            Tokenization::from_arg("estimate"),
            Ok(Tokenization::Estimate)
        ));
    }
}
