//! The assistant's reply as the chat API returns it: text split into
//! reasoning (with --reasoning-parser), content and tool calls (when the
//! request has tools), whole or streamed.
//! Every route that speaks chat (Chat Completions, Responses, Messages)
//! reads replies through here.

use crate::http::openai::types::{FunctionCallOut, ToolCallOut};
use crate::reasoning::{self, ReasoningStreamer};
use crate::tools::call_stream::{Piece, ToolStreamer};
use crate::tools::parse::parse;
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
        if self.tool_calls.is_empty() {
            generated.to_string()
        } else {
            "tool_calls".to_string()
        }
    }
}

pub fn tool_call_out(c: ToolCall) -> ToolCallOut {
    ToolCallOut {
        id: call_id(),
        kind: "function".into(),
        function: FunctionCallOut { name: c.name, arguments: c.arguments },
    }
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

/// A tool call's part of a streamed step.
#[derive(Debug, Clone, PartialEq)]
pub enum CallDelta {
    /// The call begins: its id and function name (`index` counts the reply's calls).
    Start { index: u32, id: String, name: String },
    /// A fragment of its JSON arguments.
    Args { index: u32, text: String },
    /// The call is over; `arguments` is all of it.
    End { index: u32, id: String, name: String, arguments: String },
}

/// What one streamed step adds to a reply.
#[derive(Debug, Default)]
pub struct StepDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<CallDelta>,
}

/// Splits a reply as it streams.
pub struct StreamSplitter {
    think: Option<ReasoningStreamer>,
    tools: Option<(ToolStreamer, bool)>,
    /// (id, name, arguments so far) of each call sent.
    calls: Vec<(String, String, String)>,
}

impl StreamSplitter {
    pub fn new(plan: Option<&ToolPlan>, think: Option<bool>) -> Self {
        Self {
            think: think.map(ReasoningStreamer::new),
            tools: plan.map(|p| (ToolStreamer::new(p.format, &p.names()), p.parallel)),
            calls: Vec::new(),
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
        // Without parallel_tool_calls only the first call is sent.
        let keep = |index: u32| *parallel || index == 0;
        let mut delta = StepDelta { reasoning, ..Default::default() };
        for p in pieces {
            match p {
                Piece::Content(c) => delta.content.push_str(&c),
                Piece::CallStart { index, name } if keep(index) => {
                    let id = call_id();
                    self.calls.push((id.clone(), name.clone(), String::new()));
                    delta.tool_calls.push(CallDelta::Start { index, id, name });
                }
                Piece::CallArgs { index, text } if keep(index) => {
                    self.calls[index as usize].2.push_str(&text);
                    // Fragments of one step go out as one.
                    match delta.tool_calls.last_mut() {
                        Some(CallDelta::Args { index: i, text: t }) if *i == index => t.push_str(&text),
                        _ => delta.tool_calls.push(CallDelta::Args { index, text }),
                    }
                }
                Piece::CallEnd { index } if keep(index) => {
                    let (id, name, arguments) = self.calls[index as usize].clone();
                    delta.tool_calls.push(CallDelta::End { index, id, name, arguments });
                }
                _ => {}
            }
        }
        delta
    }

    pub fn made_calls(&self) -> bool {
        !self.calls.is_empty()
    }

    /// Whether the reply ended inside a call it had sent: the finish is then the generation's own
    /// (`length`), telling the client the last call's arguments are incomplete.
    pub fn cut_off(&self) -> bool {
        self.tools.as_ref().is_some_and(|(t, _)| t.cut_off())
    }

    /// The finish to report: tool calls when the reply made whole ones.
    pub fn calls_finished(&self) -> bool {
        self.made_calls() && !self.cut_off()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{Tool, ToolCallParser};

    #[test]
    fn one_call_without_parallel_calls() {
        let tools: Vec<Tool> = serde_json::from_value(serde_json::json!([
            {"type": "function", "function": {"name": "add"}}]))
        .unwrap();
        let plan = ToolPlan::new(ToolCallParser::Hermes, Some(&tools), None, Some(false)).unwrap().unwrap();
        let mut s = StreamSplitter::new(Some(&plan), None);
        let text = "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call><tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>";
        let mut all = Vec::new();
        for (i, c) in text.chars().enumerate() {
            all.extend(s.push(&c.to_string(), i + 1 == text.chars().count()).tool_calls);
        }
        let ends: Vec<_> = all
            .iter()
            .filter_map(|d| match d {
                CallDelta::End { arguments, .. } => Some(arguments.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(ends, [r#"{"a": 1}"#]);
        assert!(all.iter().all(|d| !matches!(d, CallDelta::Start { index: 1, .. })));
        let CallDelta::Start { id, .. } = &all[0] else { panic!("{all:?}") };
        assert!(id.starts_with("call_"));
    }
}
