//! Messages streaming: `message_start`, then content blocks (thinking,
//! text, tool_use) each opened, filled with deltas and closed, then
//! `message_delta` (stop reason, output tokens) and `message_stop`. Every
//! event is named, as the `anthropic` client dispatches on the name.

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::types::tool_use_id;
use crate::http::chat::reply::{CallDelta, StepDelta};

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    /// A tool call, its input streamed as `input_json_delta`s.
    ToolUse,
}

/// Turns a reply's steps into Messages events.
pub struct MessageEvents {
    /// The `message` object of `message_start` (empty content, null stop reason).
    start: Option<Value>,
    open: Option<Block>,
    next_index: u32,
}

impl MessageEvents {
    pub fn new(start_message: Value) -> Self {
        Self { start: Some(start_message), open: None, next_index: 0 }
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        if self.open.take().is_some() {
            out.push(event("content_block_stop", json!({"type": "content_block_stop", "index": self.next_index - 1})));
        }
    }

    fn delta(&mut self, block: Block, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(block) {
            self.close(out);
            let start = match block {
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Block::Text | Block::ToolUse => json!({"type": "text", "text": ""}),
            };
            out.push(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.next_index, "content_block": start}),
            ));
            self.next_index += 1;
            self.open = Some(block);
        }
        let delta = match block {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Block::Text | Block::ToolUse => json!({"type": "text_delta", "text": text}),
        };
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next_index - 1, "delta": delta}),
        ));
    }

    /// The events of one step; `end` = (stop reason, output tokens) on the last.
    pub fn step(&mut self, step: StepDelta, end: Option<(&str, u32)>) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some(message) = self.start.take() {
            out.push(event("message_start", json!({"type": "message_start", "message": message})));
        }
        self.delta(Block::Thinking, &step.reasoning, &mut out);
        self.delta(Block::Text, &step.content, &mut out);
        for call in step.tool_calls {
            match call {
                CallDelta::Start { id, name, .. } => {
                    self.close(&mut out);
                    let index = self.next_index;
                    self.next_index += 1;
                    self.open = Some(Block::ToolUse);
                    out.push(event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index,
                        "content_block": {"type": "tool_use", "id": tool_use_id(&id), "name": name, "input": {}}}),
                    ));
                }
                CallDelta::Args { text, .. } if self.open == Some(Block::ToolUse) => {
                    out.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta",
                        "index": self.next_index - 1, "delta": {"type": "input_json_delta", "partial_json": text}}),
                    ));
                }
                CallDelta::Args { .. } => {}
                CallDelta::End { .. } => {
                    if self.open == Some(Block::ToolUse) {
                        self.close(&mut out);
                    }
                }
            }
        }
        if let Some((reason, output_tokens)) = end {
            self.close(&mut out);
            out.push(event(
                "message_delta",
                json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": null},
                "usage": {"output_tokens": output_tokens}}),
            ));
            out.push(event("message_stop", json!({"type": "message_stop"})));
        }
        out
    }
}
