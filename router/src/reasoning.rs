//! Reasoning models (`--reasoning-parser`): the `<think>...</think>` block
//! of Qwen3 / DeepSeek-R1 style models is split from the answer into
//! `reasoning_content`, and a request's grammar (response_format, forced
//! tool calls) is moved after the block so the reasoning stays free.
//!
//! The block is open from the start when the rendered prompt ends with
//! `<think>` (templates that open it for the model), or when the reply
//! starts with it; otherwise the whole reply is the answer.

use serde::Serialize;

use crate::tools::markers::held_prefix;

pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";

/// The reasoning conventions the router can split (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningParser {
    /// `<think>reasoning</think>answer` (Qwen3, DeepSeek-R1 and their distills).
    #[value(name = "think", alias = "qwen3", alias = "deepseek_r1")]
    Think,
}

/// Whether the model starts generating inside an open think block.
pub fn opened_by_prompt(prompt: &str) -> bool {
    prompt.trim_end().ends_with(OPEN)
}

/// (reasoning, answer) of a whole reply; reasoning is None when there was no block.
/// An unclosed block (cut by max_tokens) is all reasoning.
pub fn split(text: &str, opened: bool) -> (Option<String>, String) {
    let body = if opened {
        text
    } else {
        match text.trim_start().strip_prefix(OPEN) {
            Some(rest) => rest,
            None => return (None, text.to_string()),
        }
    };
    match body.find(CLOSE) {
        Some(i) => (Some(body[..i].to_string()), body[i + CLOSE.len()..].trim_start().to_string()),
        None => (Some(body.to_string()), String::new()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Not opened by the prompt: is the reply starting with `<think>`?
    Start,
    Reasoning,
    /// After the block; whitespace before the answer is dropped.
    Answer {
        started: bool,
    },
}

/// `split` for a streamed reply: text in, (reasoning, answer) deltas out.
pub struct ReasoningStreamer {
    state: State,
    buf: String,
}

impl ReasoningStreamer {
    pub fn new(opened: bool) -> Self {
        Self { state: if opened { State::Reasoning } else { State::Start }, buf: String::new() }
    }

    pub fn push(&mut self, delta: &str) -> (String, String) {
        self.buf.push_str(delta);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning;
                    } else if OPEN.starts_with(t) {
                        break; // may still become `<think>`
                    } else {
                        self.state = State::Answer { started: true };
                    }
                }
                State::Reasoning => {
                    if let Some(i) = self.buf.find(CLOSE) {
                        reasoning.push_str(&self.buf[..i]);
                        self.buf.drain(..i + CLOSE.len());
                        self.state = State::Answer { started: false };
                        continue;
                    }
                    let keep = held_prefix(&self.buf, CLOSE);
                    reasoning.extend(self.buf.drain(..self.buf.len() - keep));
                    break;
                }
                State::Answer { started } => {
                    if !started {
                        let t = self.buf.trim_start();
                        if t.is_empty() {
                            self.buf.clear();
                            break;
                        }
                        self.buf = t.to_string();
                        self.state = State::Answer { started: true };
                    }
                    answer.push_str(&std::mem::take(&mut self.buf));
                    break;
                }
            }
        }
        (reasoning, answer)
    }

    /// The end of the reply: what was held back.
    pub fn finish(&mut self) -> (String, String) {
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::Reasoning => (buf, String::new()),
            State::Answer { started: false } => (String::new(), String::new()),
            State::Start | State::Answer { .. } => (String::new(), buf),
        }
    }
}

/// The request's grammar moved after the think block: `answer` is a Lark
/// grammar whose start rule is `start`; reasoning is any text without
/// `</think>`. The tags are matched as text or, where the tokenizer has
/// them as added tokens (which llguidance treats as special), by token id.
pub fn wrap_grammar(answer: &str, opened: bool, tag_ids: (Option<u32>, Option<u32>)) -> String {
    let renamed: Vec<String> = answer
        .lines()
        .map(|l| match l.strip_prefix("start:") {
            Some(rest) => format!("answer:{rest}"),
            None => l.to_string(),
        })
        .collect();
    let tag = |text: &str, id: Option<u32>| match id {
        Some(id) => format!("\"{text}\" | <[{id}]>"),
        None => format!("\"{text}\""),
    };
    let head = if opened {
        "start: REASONING? think_close WS? answer".to_string()
    } else {
        format!("start: (think_open REASONING? think_close WS?)? answer\nthink_open: {}", tag(OPEN, tag_ids.0))
    };
    format!(
        "{head}\nthink_close: {}\nREASONING: /(?s:.*)/ & ~/(?s:.*<\\/think>.*)/\nWS: /[ \\t\\r\\n]+/\n{}\n",
        tag(CLOSE, tag_ids.1),
        renamed.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    // Replies recorded from Qwen3 (opens the block itself) and DeepSeek-R1 distills (the prompt opens it).
    const RECORDED: &[(&str, bool)] = &[
        ("<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", false),
        ("Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", true),
        ("Still thinking when max_tokens hit", true),
        ("Plain answer, no block.", false),
        ("  <thin", false),
        ("<think>a</think>", false),
        ("x </thin y</think>z</think>w", true),
    ];

    #[test]
    fn whole_replies() {
        assert_eq!(
            split(RECORDED[0].0, false),
            (Some("\nThe user greets me.\n".into()), "Hello! How can I help?".into())
        );
        assert_eq!(split(RECORDED[1].0, true), (Some("Okay, 2+2 is 4.\n".into()), "The answer is 4.".into()));
        assert_eq!(split(RECORDED[2].0, true), (Some(RECORDED[2].0.into()), String::new()));
        assert_eq!(split(RECORDED[3].0, false), (None, RECORDED[3].0.into()));
        assert_eq!(split(RECORDED[6].0, true), (Some("x </thin y".into()), "z</think>w".into()));
        assert!(opened_by_prompt("<|im_start|>assistant\n<think>\n") && !opened_by_prompt("assistant\n"));
    }

    #[test]
    fn streamed_equals_whole_at_every_split() {
        for &(text, opened) in RECORDED {
            let (want_r, want_a) = split(text, opened);
            let chars: Vec<char> = text.chars().collect();
            for step in [1, 2, 3, 5, 100] {
                let mut s = ReasoningStreamer::new(opened);
                let (mut r, mut a) = (String::new(), String::new());
                for c in chars.chunks(step) {
                    let (dr, da) = s.push(&c.iter().collect::<String>());
                    r.push_str(&dr);
                    a.push_str(&da);
                }
                let (dr, da) = s.finish();
                r.push_str(&dr);
                a.push_str(&da);
                assert_eq!(r, want_r.clone().unwrap_or_default(), "{text:?} step {step}");
                assert_eq!(a, want_a, "{text:?} step {step}");
            }
        }
    }

    #[test]
    fn reasoning_streams_before_the_block_closes() {
        let mut s = ReasoningStreamer::new(true);
        assert_eq!(s.push("Let me see</th"), ("Let me see".into(), String::new()));
        assert_eq!(s.push("ink>\n\nYes"), (String::new(), "Yes".into()));
    }

    #[test]
    fn grammar_goes_after_the_block() {
        let g = wrap_grammar("start: call\ncall: \"x\"\n", true, (None, Some(7)));
        assert!(g.starts_with("start: REASONING? think_close WS? answer\nthink_close: \"</think>\" | <[7]>\n"), "{g}");
        assert!(g.contains("\nanswer: call\ncall: \"x\"\n"), "{g}");
        let g = wrap_grammar("start: \"x\"", false, (None, None));
        assert!(
            g.starts_with("start: (think_open REASONING? think_close WS?)? answer\nthink_open: \"<think>\"\n"),
            "{g}"
        );
    }
}
