//! The assistant's reply as the chat API returns it: text split into
//! reasoning (with --reasoning-parser), content and tool calls (when the
//! request has tools), whole or streamed.
//! Every route that speaks chat (Chat Completions, Responses, Messages)
//! reads replies through here.

use super::types::{FunctionCallOut, ToolCallOut};
use crate::reasoning::{self, ReasoningStreamer};
use crate::tools::parse::parse;
use crate::tools::stream::{Piece, ToolStreamer};
use crate::tools::{call_id, ToolCall, ToolPlan};

/// A finished reply.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// The think block's text; None without --reasoning-parser or without a block.
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ToolCallOut>,
}

impl Reply {
    /// OpenAI's finish reason, given the generation's own.
    pub fn finish_reason(&self, generated: &str) -> String {
        if self.tool_calls.is_empty() { generated.to_string() } else { "tool_calls".to_string() }
    }
}

pub fn tool_call_out(c: ToolCall) -> ToolCallOut {
    ToolCallOut { id: call_id(), kind: "function".into(), function: FunctionCallOut { name: c.name, arguments: c.arguments } }
}

/// Splits a whole reply. `think`: with a reasoning parser, whether the
/// prompt opened the think block.
pub fn split(plan: Option<&ToolPlan>, think: Option<bool>, text: &str) -> Reply {
    let (reasoning, answer) = match think {
        Some(opened) => reasoning::split(text, opened),
        None => (None, text.to_string()),
    };
    let Some(plan) = plan else { return Reply { reasoning, content: answer, tool_calls: vec![] } };
    let parsed = parse(plan.format, &answer, &plan.names());
    let keep = if plan.parallel { usize::MAX } else { 1 };
    Reply {
        reasoning,
        content: parsed.content,
        tool_calls: parsed.calls.into_iter().take(keep).map(tool_call_out).collect(),
    }
}

/// What one streamed step adds to a reply.
#[derive(Debug, Default)]
pub struct StepDelta {
    pub reasoning: String,
    pub content: String,
    /// (index within the reply, call)
    pub tool_calls: Vec<(u32, ToolCallOut)>,
}

/// Splits a reply as it streams.
pub struct StreamSplitter {
    think: Option<ReasoningStreamer>,
    tools: Option<(ToolStreamer, bool)>,
    calls: u32,
}

impl StreamSplitter {
    pub fn new(plan: Option<&ToolPlan>, think: Option<bool>) -> Self {
        Self {
            think: think.map(ReasoningStreamer::new),
            tools: plan.map(|p| (ToolStreamer::new(p.format, &p.names()), p.parallel)),
            calls: 0,
        }
    }

    /// The text of one step; `last` at the end of the reply.
    pub fn push(&mut self, text: &str, last: bool) -> StepDelta {
        let (reasoning, answer) = match &mut self.think {
            None => (String::new(), text.to_string()),
            Some(t) => {
                let (mut r, mut a) = t.push(text);
                if last {
                    let (fr, fa) = t.finish();
                    r.push_str(&fr);
                    a.push_str(&fa);
                }
                (r, a)
            }
        };
        let Some((streamer, parallel)) = &mut self.tools else {
            return StepDelta { reasoning, content: answer, tool_calls: vec![] };
        };
        let mut pieces = streamer.push(&answer);
        if last {
            pieces.extend(streamer.finish());
        }
        let parallel = *parallel;
        let mut delta = StepDelta { reasoning, ..Default::default() };
        for p in pieces {
            match p {
                Piece::Content(c) => delta.content.push_str(&c),
                Piece::Call(c) if parallel || self.calls == 0 => {
                    delta.tool_calls.push((self.calls, tool_call_out(c)));
                    self.calls += 1;
                }
                Piece::Call(_) => {}
            }
        }
        delta
    }

    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }
}
