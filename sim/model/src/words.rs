//! Deterministic text made of real English words.
//!
//! Prompts and outputs are built from this list so that text looks like
//! text (about 4–5 bytes per word with its leading space, close to the
//! 4 bytes per token that kvroute's token estimate assumes) and so that a
//! seed fixes every byte.

use kvroute_core::scheduling::Rng;
use std::sync::LazyLock;

/// Common English words (`data/words.txt`, one per line, in order: a
/// seed picks words by index, so reordering the file changes every text).
pub static WORDS: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    include_str!("../data/words.txt")
        .lines()
        .filter(|w| !w.is_empty())
        .collect()
});

/// Appends words from `rng` until `text` is at least `bytes` long, then cuts
/// it to exactly `bytes` bytes (all words are ASCII, so any cut is valid
/// UTF-8).
pub fn fill_to_bytes(text: &mut String, bytes: usize, rng: &mut Rng) {
    while text.len() < bytes {
        let w = WORDS[rng.below(WORDS.len() as u64) as usize];
        text.push(' ');
        text.push_str(w);
    }
    text.truncate(bytes);
}

/// Deterministic text of exactly `bytes` bytes.
pub fn text_of_bytes(bytes: usize, rng: &mut Rng) -> String {
    let mut s = String::with_capacity(bytes + 16);
    fill_to_bytes(&mut s, bytes, rng);
    s
}

/// The `i`-th output word of a stream seeded by `seed`, with a leading space.
pub fn output_word(seed: u64, i: u64) -> &'static str {
    let mut r = Rng::derive(seed, i);
    WORDS[r.below(WORDS.len() as u64) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_length_and_deterministic() {
        let a = text_of_bytes(1001, &mut Rng::new(3));
        let b = text_of_bytes(1001, &mut Rng::new(3));
        assert_eq!(a.len(), 1001);
        assert_eq!(a, b);
        assert_ne!(a, text_of_bytes(1001, &mut Rng::new(4)));
        assert!(a.split(' ').filter(|w| !w.is_empty()).count() > 150);
    }

    #[test]
    fn the_list_is_plain_ascii_words() {
        // A stray blank, space or non-ASCII byte in data/words.txt would
        // change text lengths and cuts (fill_to_bytes cuts at any byte).
        assert_eq!(WORDS.len(), 988);
        for w in WORDS.iter() {
            assert!(
                !w.is_empty() && w.bytes().all(|b| b.is_ascii_lowercase() || b == b'\''),
                "{w:?}"
            );
        }
    }
}
