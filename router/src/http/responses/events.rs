//! The Responses API's typed streaming events: `response.created`, then per
//! output item `response.output_item.added`, its deltas
//! (`response.output_text.delta`, `response.function_call_arguments.delta`)
//! and `.done` events, and `response.completed` (or `.incomplete`) with the
//! whole response. Each event is named by its type and numbered.

use axum::response::sse::Event;
use serde_json::{json, Value};

use super::items::{call_item, call_item_id, message_item, reasoning_item};
use super::types::ResponseObject;
use crate::http::chat::reply::{CallDelta, StepDelta};

pub struct ResponseEvents {
    obj: ResponseObject,
    id: String,
    seq: u64,
    started: bool,
    /// The open message item: (output index, text so far).
    message: Option<(usize, String)>,
    /// Reasoning is sent as one item once it is over.
    reasoning: Option<String>,
    /// Calls begun and not yet done: (index in the reply, output index, call id).
    calls: Vec<(u32, usize, String)>,
}

impl ResponseEvents {
    pub fn new(obj: ResponseObject, id: &str) -> Self {
        Self { obj, id: id.to_string(), seq: 0, started: false, message: None, reasoning: None, calls: vec![] }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default().event(kind).data(data.to_string())
    }

    fn msg_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn flush_reasoning(&mut self, out: &mut Vec<Event>) {
        if let Some(text) = self.reasoning.take() {
            let item = reasoning_item(&format!("rs_{}", self.id), &text);
            let index = self.obj.output.len();
            out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
            out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
            self.obj.output.push(item);
        }
    }

    fn close_message(&mut self, out: &mut Vec<Event>) {
        let Some((index, text)) = self.message.take() else { return };
        let id = self.msg_id();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        out.push(self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": index,
            "content_index": 0, "text": text, "logprobs": []}),
        ));
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": at["item_id"], "output_index": index,
            "content_index": 0, "part": part}),
        ));
        let item = message_item(&id, &text, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.obj.output.push(item);
    }

    pub fn step(&mut self, step: StepDelta) -> Vec<Event> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let r = serde_json::to_value(&self.obj).unwrap_or_default();
            out.push(self.event("response.created", json!({"response": r})));
            out.push(self.event("response.in_progress", json!({"response": r})));
        }
        if !step.reasoning.is_empty() {
            self.reasoning.get_or_insert_with(String::new).push_str(&step.reasoning);
        }
        if !step.content.is_empty() {
            self.flush_reasoning(&mut out);
            if self.message.is_none() {
                let index = self.obj.output.len();
                let id = self.msg_id();
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": message_item(&id, "", "in_progress")}),
                ));
                out.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index,
                    "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
                ));
                self.message = Some((index, String::new()));
            }
            let id = self.msg_id();
            let index = self.message.as_ref().map_or(0, |m| m.0);
            out.push(self.event(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index,
                "content_index": 0, "delta": step.content, "logprobs": []}),
            ));
            if let Some((_, text)) = &mut self.message {
                text.push_str(&step.content);
            }
        }
        for call in step.tool_calls {
            match call {
                CallDelta::Start { index, id, name } => {
                    self.flush_reasoning(&mut out);
                    self.close_message(&mut out);
                    let at = self.obj.output.len() + self.calls.len();
                    let item = call_item(&id, &name, "", "in_progress");
                    out.push(self.event("response.output_item.added", json!({"output_index": at, "item": item})));
                    self.calls.push((index, at, id));
                }
                CallDelta::Args { index, text } => {
                    let Some((_, at, id)) = self.calls.iter().find(|c| c.0 == index) else { continue };
                    let (at, item_id) = (*at, call_item_id(id));
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": at, "delta": text}),
                    ));
                }
                CallDelta::End { index, id, name, arguments } => {
                    let Some(pos) = self.calls.iter().position(|c| c.0 == index) else { continue };
                    let (_, at, _) = self.calls.remove(pos);
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": call_item_id(&id), "output_index": at, "arguments": arguments}),
                    ));
                    let done = call_item(&id, &name, &arguments, "completed");
                    out.push(self.event("response.output_item.done", json!({"output_index": at, "item": done})));
                    self.obj.output.push(done);
                }
            }
        }
        out
    }

    /// The last events; `finish` sets the final status and usage.
    pub fn end(&mut self, finish: impl FnOnce(&mut ResponseObject)) -> Vec<Event> {
        let mut out = Vec::new();
        self.flush_reasoning(&mut out);
        self.close_message(&mut out);
        finish(&mut self.obj);
        let kind = if self.obj.status == "incomplete" { "response.incomplete" } else { "response.completed" };
        let r = serde_json::to_value(&self.obj).unwrap_or_default();
        out.push(self.event(kind, json!({"response": r})));
        out
    }
}
