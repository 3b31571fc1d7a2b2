//! The Responses API's output items (message, function call, reasoning),
//! as the whole response and its stream events both write them.

use serde_json::{json, Value};

pub fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": if status == "completed" || !text.is_empty() {
               json!([{"type": "output_text", "text": text, "annotations": []}]) } else { json!([]) }})
}

/// `fc_...` for the call `call_...`.
pub fn call_item_id(call_id: &str) -> String {
    format!("fc_{}", call_id.trim_start_matches("call_"))
}

pub fn call_item(call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": call_item_id(call_id),
           "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}
