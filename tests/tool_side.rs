//! The tool face: any tool call on the one ledger — conformance over every store, the
//! face's own behaviour, and randomized faults, crashes and regenerated arguments.
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod tool_side {
    mod defining_fields;
    mod face;
    mod randomized;
    mod read_back;
    mod seams;
    mod stores;
}
