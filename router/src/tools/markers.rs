//! The marker strings the tool-call formats write around calls, and the
//! rule a streaming reader holds text back by: a tail that may still grow
//! into a marker is not sent yet (also used for reasoning's think tags).

pub const HERMES_OPEN: &str = "<tool_call>";
pub const HERMES_CLOSE: &str = "</tool_call>";
pub const MISTRAL_MARKER: &str = "[TOOL_CALLS]";
pub const MISTRAL_ARGS: &str = "[ARGS]";
pub const MISTRAL_CALL_ID: &str = "[CALL_ID]";
pub const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
pub fn held_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}
