//! The chat pipeline every chat-shaped route shares: Chat Completions,
//! Responses and Messages translate their requests into a
//! `ChatCompletionRequest`, which is rendered with the chat template
//! (prompt.rs), planned for tools, reasoning and grammar (prepare.rs), and
//! whose generated text is split into reasoning, content and tool calls
//! (reply.rs), whole or streamed. The chat fields of vLLM's and SGLang's
//! servers are read in engine_chat.rs.

pub mod engine_chat;
pub mod prepare;
pub mod prompt;
pub mod reply;
