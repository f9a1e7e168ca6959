//! The ledger's Lua scripts, one per transition, as Redis runs them.
//!
//! Each is the shared prelude (`prelude.lua`: the record format, the clock, the released
//! marker) followed by its own file, hashed once per process and invoked by SHA.

use std::sync::LazyLock;

use ::redis::Script;

// The scripts' sources. The prelude is prepended at compile time because Redis scripts
// cannot include files.
const BEGIN_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("begin.lua"));
const COMPLETE_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("complete.lua"));
const ABANDON_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("abandon.lua"));
const MARK_IN_DOUBT_LUA: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("mark_in_doubt.lua")
);
const RENEW_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("renew.lua"));
const INSPECT_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("inspect.lua"));
const FORGET_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("forget.lua"));
const RESOLVE_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("resolve.lua"));
const LIST_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("list.lua"));

/// Every script, for loading them all when the store connects.
pub(super) const ALL_SCRIPTS: [&str; 9] = [
    BEGIN_LUA,
    COMPLETE_LUA,
    ABANDON_LUA,
    MARK_IN_DOUBT_LUA,
    RENEW_LUA,
    INSPECT_LUA,
    FORGET_LUA,
    RESOLVE_LUA,
    LIST_LUA,
];

// Each script is hashed once per process; `Script` invokes by SHA and loads on NOSCRIPT.
pub(super) static BEGIN: LazyLock<Script> = LazyLock::new(|| Script::new(BEGIN_LUA));
pub(super) static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));
pub(super) static ABANDON: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON_LUA));
pub(super) static MARK_IN_DOUBT: LazyLock<Script> =
    LazyLock::new(|| Script::new(MARK_IN_DOUBT_LUA));
pub(super) static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));
pub(super) static INSPECT: LazyLock<Script> = LazyLock::new(|| Script::new(INSPECT_LUA));
pub(super) static FORGET: LazyLock<Script> = LazyLock::new(|| Script::new(FORGET_LUA));
pub(super) static RESOLVE: LazyLock<Script> = LazyLock::new(|| Script::new(RESOLVE_LUA));
pub(super) static LIST: LazyLock<Script> = LazyLock::new(|| Script::new(LIST_LUA));
