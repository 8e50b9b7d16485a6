//! Precise mode's tokenizer in a build without the `tokenizer` feature (the
//! smaller module: no `tokenizers`, no `minijinja`). [`ModelTokenizer`] has
//! no values, so none can be loaded: `load` says why, which makes a config
//! that names a `tokenizerJson` fail at configure with that message. A
//! configured model without a tokenizer (llm-d's UDS tokenizer) routes its
//! text and chat prompts on the approximate index (`no_tokenizer`), and
//! token-ID prompts are hashed exactly as in the full build.

pub use super::TokenizeError;
use crate::request::ChatTemplateInputs;

/// A tokenizer this build cannot load (no values).
#[derive(Debug)]
pub enum ModelTokenizer {}

impl ModelTokenizer {
    /// Always an error: this build has no tokenizer.
    pub fn load(
        _tokenizer_json: &[u8],
        _tokenizer_config: Option<&serde_json::Value>,
        _chat_template: Option<&str>,
    ) -> Result<ModelTokenizer, String> {
        Err(
            "this kvroute module was built without the `tokenizer` feature, so it cannot tokenize \
             text or chat prompts; use the default build, or leave `tokenizerJson` out (token-ID \
             prompts are hashed without a tokenizer)"
                .to_owned(),
        )
    }

    /// Token IDs of a `/v1/completions` body's text prompt (no value can call it).
    pub fn completion_ids(&self, _body: &[u8], _prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        match *self {}
    }

    /// Token IDs of a chat body (no value can call it).
    pub fn chat_ids(&self, _body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        match *self {}
    }

    /// Token IDs of a parsed chat body (no value can call it).
    pub fn chat_ids_from(&self, _chat: &ChatTemplateInputs) -> Result<Vec<u32>, TokenizeError> {
        match *self {}
    }
}

/// A model tokenized off the request path: this build has none (no values).
#[derive(Debug)]
pub enum OffPathModel {}

impl OffPathModel {
    /// Always an error: this build has no tokenizer (the message
    /// [`ModelTokenizer::load`] gives).
    pub fn refused() -> String {
        match ModelTokenizer::load(b"", None, None) {
            Err(e) => e,
            Ok(t) => match t {},
        }
    }
}
