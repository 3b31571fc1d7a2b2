//! A chat request made ready to generate: prompt rendered, sampling
//! parameters checked, tool calling and reasoning planned, and the grammar
//! that forces calls (placed after the think block of reasoning models).
//! Chat Completions, Responses and Messages all translate their requests
//! into a `ChatCompletionRequest` and come through here.

use super::prompt::render_prompt;
use crate::error::RouterError;
use crate::http::openai::types::ChatCompletionRequest;
use crate::http::AppState;
use crate::infer::GenerateInput;
use crate::reasoning;
use crate::tools::{self, ToolPlan};

pub struct PreparedChat {
    pub input: GenerateInput,
    /// Choices to generate.
    pub n: u32,
    /// None without tools or with tool_choice "none".
    pub plan: Option<ToolPlan>,
    /// With --reasoning-parser: whether the prompt opened the think block.
    pub think: Option<bool>,
}

pub fn prepare(app: &AppState, req: &ChatCompletionRequest, top_n: Option<u32>) -> Result<PreparedChat, RouterError> {
    let invalid = |m: &str| RouterError::Validation(m.to_string());
    req.check_engine_fields()?;
    // An unknown model is a 404 whatever else the request gets wrong.
    let adapter = app.lora.for_model(req.sampling.model.as_deref())?;
    let prompt = render_prompt(app, req)?;
    let mut parameters = req.sampling.to_parameters(req.max_new_tokens()?, top_n)?;
    parameters.adapter = adapter;
    let plan = ToolPlan::new(app.tool_format, req.tools.as_deref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    if let Some(p) = &plan {
        if let Some(forced) = &p.force {
            if parameters.grammar.is_some() {
                return Err(invalid("`response_format` cannot be combined with a forced `tool_choice`"));
            }
            let tokenizer = app.infer.validation().tokenizer();
            let ids = (tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>"));
            parameters.extras.lark = Some(tools::call_grammar::lark(p.format, forced, p.parallel, ids));
        }
    }
    let think = app.reasoning_parser.map(|_| reasoning::opened_by_prompt(&prompt));
    if let Some(opened) = think {
        let answer = match (parameters.extras.lark.take(), parameters.grammar.take()) {
            (Some(lark), _) => Some(lark),
            (None, Some(g)) => Some(crate::grammar::to_lark(&g)?),
            (None, None) => None,
        };
        let tokenizer = app.infer.validation().tokenizer();
        let ids = (tokenizer.token_to_id(reasoning::OPEN), tokenizer.token_to_id(reasoning::CLOSE));
        parameters.extras.lark = answer.map(|a| reasoning::wrap_grammar(&a, opened, ids));
    }
    let input = GenerateInput { add_special_tokens: false, ..GenerateInput::new(prompt, parameters) };
    Ok(PreparedChat { input, n: req.sampling.n.unwrap_or(1), plan, think })
}
