//! Reads vLLM's `GET /v1/models`: the served base models and the loaded
//! LoRA adapters.
//!
//! vLLM 0.32 (`entrypoints/openai/models/serving.py`) answers
//! `{"object":"list","data":[card…]}`: one card per served model name
//! (`id`, `root` the model path, no `parent`) and one per loaded adapter
//! (`id` the adapter's name, `root` its path, `parent` its base model).
//! Statically loaded adapters (`--lora-modules`) appear here even while
//! idle, which `/metrics` cannot show.
//!
//! The body is untrusted: anything that is not this shape is an error
//! value, other fields are ignored, and at most [`MAX_CARDS`] cards are
//! read (the shared table keeps fewer still,
//! `kvroute_shared_state::models::MAX_NAMES`).

use serde::Deserialize;

/// Most cards read from one answer.
pub const MAX_CARDS: usize = 256;

/// One model card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelCard {
    pub id: String,
    /// The base model it adapts (`parent`), for a LoRA adapter.
    pub parent: Option<String>,
    /// `root`: a base model's path, or an adapter's (the `path` of its
    /// `--lora-modules name=path`, which vLLM hashes its blocks with).
    pub root: Option<String>,
}

impl ModelCard {
    pub fn is_adapter(&self) -> bool {
        self.parent.is_some()
    }
}

#[derive(Deserialize)]
struct RawList {
    data: Vec<RawCard>,
}

#[derive(Deserialize)]
struct RawCard {
    id: String,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default)]
    root: Option<String>,
}

/// The cards of a `/v1/models` answer, at most [`MAX_CARDS`].
pub fn parse(body: &[u8]) -> Result<Vec<ModelCard>, String> {
    let list: RawList =
        serde_json::from_slice(body).map_err(|e| format!("/v1/models answer: {e}"))?;
    Ok(list
        .data
        .into_iter()
        .filter(|c| !c.id.is_empty())
        .take(MAX_CARDS)
        .map(|c| ModelCard {
            id: c.id,
            parent: c.parent.filter(|p| !p.is_empty()),
            root: c.root.filter(|r| !r.is_empty()),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_models_and_adapters() {
        // The shape vLLM 0.32 answers with one base model and one adapter.
        let body = br#"{"object":"list","data":[
{"id":"tiny","object":"model","created":1795942140,"owned_by":"vllm","root":"/models/tiny","parent":null,"max_model_len":4096,"permission":[{"id":"modelperm-1","object":"model_permission","allow_sampling":true}]},
{"id":"sql-lora","object":"model","created":1795942140,"owned_by":"vllm","root":"/adapters/sql","parent":"tiny","max_model_len":null,"permission":[]}]}"#;
        let cards = parse(body).unwrap();
        assert_eq!(
            cards,
            vec![
                ModelCard {
                    id: "tiny".into(),
                    parent: None,
                    root: Some("/models/tiny".into()),
                },
                ModelCard {
                    id: "sql-lora".into(),
                    parent: Some("tiny".into()),
                    root: Some("/adapters/sql".into()),
                }
            ]
        );
        assert!(!cards[0].is_adapter() && cards[1].is_adapter());
    }

    /// Real vLLM 0.32 with two static adapters (`--lora-modules`), before
    /// any request.
    #[test]
    fn real_vllm_lora_capture() {
        let cards = parse(include_bytes!(
            "../../../../testdata/vllm/models-vllm-0.32-cpu-lora.json"
        ))
        .unwrap();
        let got: Vec<(&str, Option<&str>, Option<&str>)> = cards
            .iter()
            .map(|c| (c.id.as_str(), c.parent.as_deref(), c.root.as_deref()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("tiny", None, Some("/root/.cache/kvroute/vllm-0.32/model")),
                ("sql", Some("tiny"), Some("/tmp/kvr-lora/sql")),
                ("idle-lora", Some("tiny"), Some("/tmp/kvr-lora/sql"))
            ]
        );
    }

    #[test]
    fn bad_answers_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"<html>",
            b"{}",
            b"{\"data\":3}",
            b"{\"data\":[{\"id\":5}]}",
            b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            &[0xff, 0xfe],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        // Deep nesting is refused by serde_json's recursion limit.
        let deep = format!("{{\"data\":[{}]}}", "[".repeat(100_000));
        assert!(parse(deep.as_bytes()).is_err());
        let mut many = String::from("{\"data\":[");
        for i in 0..MAX_CARDS + 10 {
            many.push_str(&format!(
                "{}{{\"id\":\"m{i}\"}}",
                if i > 0 { "," } else { "" }
            ));
        }
        many.push_str("]}");
        assert_eq!(parse(many.as_bytes()).unwrap().len(), MAX_CARDS);
        assert_eq!(parse(b"{\"data\":[{\"id\":\"\"}]}").unwrap(), vec![]);
        // No root, a null one, an empty one: no path.
        let cards = parse(
            br#"{"data":[{"id":"a","parent":"b"},{"id":"c","parent":"b","root":null},{"id":"d","parent":"b","root":""}]}"#,
        )
        .unwrap();
        assert!(cards.iter().all(|c| c.root.is_none()));
    }
}
