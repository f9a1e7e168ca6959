//! `idempotency-records`: the operator's place in a terminal. Lists the records of a Redis or
//! PostgreSQL ledger, shows one, and resolves an operation left in doubt, each action
//! fenced by the look the operator took.
//!
//! ```text
//! idempotency-records --redis redis://127.0.0.1:6379/ summary
//! idempotency-records --postgres postgres://app@127.0.0.1/payments list --state in_doubt --oldest-first
//! idempotency-records --redis redis://127.0.0.1:6379/ show <key>
//! idempotency-records --redis redis://127.0.0.1:6379/ resolve-not-applied <key> --look <look> --reason "no charge at the provider"
//! idempotency-records --redis redis://127.0.0.1:6379/ forget <key> --look <look> --reason "test data"
//! ```
//!
//! `show` prints the record's look (its state, generation, attempts and fingerprint, as one
//! word); an action takes that look back and changes the record only if it is still as seen
//! (else it prints what the record is now, and exits with status 3). Options: `--prefix` (Redis,
//! default `idem:`), `--schema` (PostgreSQL, default the store's). Every action is logged to
//! standard error with the operator (`$USER`) and the reason.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::ledger::{
    Expected, Forget, Generation, LedgerKey, ListCursor, ListQuery, Origin, PostgresStore,
    RecordKind, RecordState, RecordView, Records, RedisStore, StoreError,
};

const USAGE: &str = "\
usage: idempotency-records (--redis URL [--prefix P] | --postgres URL [--schema S]) COMMAND
commands:
  summary                                   operations in doubt, and the oldest's age
  list [--state in_flight|in_doubt|completed]... [--scope S] [--older-than SECS]
       [--newer-than SECS] [--target PREFIX] [--tool NAME] [--task ID]
       [--oldest-first] [--limit N] [--after CURSOR]
  show KEY                                  one record, with its look
  resolve-not-applied KEY --look LOOK --reason TEXT
                                            an operation in doubt that did not happen:
                                            its next run sends it
  forget KEY --look LOOK --reason TEXT      remove a record as seen";

/// Exit statuses a script can tell apart.
const CHANGED: u8 = 3;
const USAGE_ERROR: u8 = 2;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(args).await {
        Ok(code) => code,
        Err(Failure::Usage(message)) => {
            eprintln!("{message}\n\n{USAGE}");
            ExitCode::from(USAGE_ERROR)
        }
        Err(Failure::Store(err)) => {
            eprintln!("the store answered: {err}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Usage(String),
    Store(StoreError),
}

impl From<StoreError> for Failure {
    fn from(err: StoreError) -> Self {
        Self::Store(err)
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure::Usage(message.into())
}

/// The arguments, taken from the front one at a time.
struct Args(std::collections::VecDeque<String>);

impl Args {
    fn next(&mut self) -> Option<String> {
        self.0.pop_front()
    }

    fn value(&mut self, option: &str) -> Result<String, Failure> {
        self.next()
            .ok_or_else(|| usage(format!("{option} needs a value")))
    }
}

async fn run(args: Vec<String>) -> Result<ExitCode, Failure> {
    let mut args = Args(args.into());
    let records = connect(&mut args).await?;
    let command = args.next().ok_or_else(|| usage("no command"))?;
    match command.as_str() {
        "summary" => summary(&records).await,
        "list" => list(&records, args).await,
        "show" => show(&records, args).await,
        "resolve-not-applied" => act(&records, args, Action::ResolveNotApplied).await,
        "forget" => act(&records, args, Action::Forget).await,
        "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        other => Err(usage(format!("unknown command {other:?}"))),
    }
}

async fn connect(args: &mut Args) -> Result<Records, Failure> {
    let (mut redis, mut postgres, mut prefix, mut schema) = (None, None, None, None);
    while let Some(option) = args.0.front().filter(|arg| arg.starts_with("--")).cloned() {
        args.next();
        match option.as_str() {
            "--redis" => redis = Some(args.value("--redis")?),
            "--postgres" => postgres = Some(args.value("--postgres")?),
            "--prefix" => prefix = Some(args.value("--prefix")?),
            "--schema" => schema = Some(args.value("--schema")?),
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    match (redis, postgres) {
        (Some(url), None) => {
            let mut builder = RedisStore::builder(url);
            if let Some(prefix) = prefix {
                builder = builder.prefix(prefix);
            }
            Ok(Records::new(builder.connect().await?))
        }
        (None, Some(url)) => {
            let mut builder = PostgresStore::builder(url);
            if let Some(schema) = schema {
                builder = builder.schema(schema);
            }
            Ok(Records::new(builder.connect().await?))
        }
        _ => Err(usage("name one store: --redis URL or --postgres URL")),
    }
}

async fn summary(records: &Records) -> Result<ExitCode, Failure> {
    let summary = records.doubt_summary().await?;
    let more = if summary.counted_all { "" } else { " or more" };
    match summary.oldest {
        Some(oldest) => println!(
            "{}{more} operations in doubt; the oldest claimed {} ago",
            summary.count,
            seconds(oldest)
        ),
        None => println!("no operation in doubt"),
    }
    Ok(ExitCode::SUCCESS)
}

async fn list(records: &Records, mut args: Args) -> Result<ExitCode, Failure> {
    let mut query = ListQuery::new();
    while let Some(option) = args.next() {
        query = match option.as_str() {
            "--state" => query.kind(kind(&args.value("--state")?)?),
            "--scope" => query.scope(&args.value("--scope")?),
            "--older-than" => query.older_than(duration(&args.value("--older-than")?)?),
            "--newer-than" => query.newer_than(duration(&args.value("--newer-than")?)?),
            "--target" => query.target(&args.value("--target")?),
            "--tool" => query.tool(&args.value("--tool")?),
            "--task" => query.task(&args.value("--task")?),
            "--oldest-first" => query.oldest_first(),
            "--limit" => query.limit(number(&args.value("--limit")?)?),
            "--after" => query.after(
                ListCursor::from_str(&args.value("--after")?)
                    .map_err(|err| usage(format!("--after: {err}")))?,
            ),
            other => return Err(usage(format!("unknown list option {other:?}"))),
        };
    }
    let page = records.list(query).await?;
    println!(
        "{:<64}  {:<10}  {:>8}  {:>10}  state  origin",
        "key", "attempts", "age", "touched"
    );
    for record in &page.records {
        let view = &record.view;
        println!(
            "{}  {:<10}  {:>8}  {:>10}  {}  {}",
            record.key.to_hex(),
            view.attempts,
            seconds(view.age),
            seconds(view.touched),
            state(&view.state),
            origin(view.origin.as_ref())
        );
    }
    match page.next {
        Some(cursor) => println!("more: --after {cursor}"),
        None => println!("({} listed; the end of the list)", page.records.len()),
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(records: &Records, mut args: Args) -> Result<ExitCode, Failure> {
    let key = key(&args.value("KEY")?)?;
    match records.inspect(key).await? {
        Some(view) => {
            print_record(key, &view);
            Ok(ExitCode::SUCCESS)
        }
        None => {
            println!("no record of {}", key.to_hex());
            Ok(ExitCode::from(CHANGED))
        }
    }
}

fn print_record(key: LedgerKey, view: &RecordView) {
    println!("key            {}", key.to_hex());
    println!("state          {}", state(&view.state));
    println!("attempts       {}", view.attempts);
    println!("generation     {}", view.generation);
    println!("claimed        {} ago", seconds(view.age));
    println!("last touched   {} ago", seconds(view.touched));
    println!("kept for       {} more", seconds(view.retention_left));
    println!("scope digest   {:016x}", view.scope);
    println!("origin         {}", origin(view.origin.as_ref()));
    println!("fingerprint    {}", view.fingerprint.to_hex());
    println!("look           {}", Look::of(view));
}

/// What a record is of, on one line: its face and target, then its task and step when an
/// operation id named them; `-` when not known.
fn origin(origin: Option<&Origin>) -> String {
    let Some(origin) = origin else {
        return "-".to_owned();
    };
    let cut = if origin.is_target_cut() { "..." } else { "" };
    match (origin.task_id(), origin.step_id()) {
        (Some(task), Some(step)) => format!(
            "{} {}{cut} (task {task:?}, step {step:?})",
            origin.face(),
            origin.target()
        ),
        _ => format!("{} {}{cut}", origin.face(), origin.target()),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    ResolveNotApplied,
    Forget,
}

async fn act(records: &Records, mut args: Args, action: Action) -> Result<ExitCode, Failure> {
    let key = key(&args.value("KEY")?)?;
    let (mut look, mut reason) = (None, None);
    while let Some(option) = args.next() {
        match option.as_str() {
            "--look" => look = Some(Look::from_str(&args.value("--look")?)?),
            "--reason" => reason = Some(args.value("--reason")?),
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    let look = look.ok_or_else(|| usage("an action needs the --look that `show` printed"))?;
    let reason = reason
        .filter(|reason| !reason.trim().is_empty())
        .ok_or_else(|| usage("an action needs a --reason"))?;
    if action == Action::ResolveNotApplied && look.0.kind != RecordKind::InDoubt {
        return Err(usage(
            "only an operation in doubt is resolved as not applied; `forget` removes others",
        ));
    }
    let operator = std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned());
    let verb = match action {
        Action::ResolveNotApplied => "resolve-not-applied",
        Action::Forget => "forget",
    };
    let answer = records.forget(key, look.0).await?;
    eprintln!(
        "audit: operator={operator:?} action={verb} key={} reason={reason:?} result={answer:?}",
        key.to_hex()
    );
    match answer {
        Forget::Forgotten => {
            println!("{verb}: done; the next run of this operation sends it");
            Ok(ExitCode::SUCCESS)
        }
        Forget::Absent => {
            println!("{verb}: no record any more; nothing to do");
            Ok(ExitCode::from(CHANGED))
        }
        Forget::Live { lease_left } => {
            println!(
                "{verb}: refused, its owner holds it under a lease that runs {} more",
                seconds(lease_left)
            );
            Ok(ExitCode::from(CHANGED))
        }
        _ => {
            println!("{verb}: refused, the record moved on since the look; it is now:");
            if let Some(view) = records.inspect(key).await? {
                print_record(key, &view);
            }
            Ok(ExitCode::from(CHANGED))
        }
    }
}

/// What an operator saw of a record, as one word: `kind.generation.attempts.fingerprint`.
struct Look(Expected);

impl Look {
    fn of(view: &RecordView) -> String {
        format!(
            "{}.{}.{}.{}",
            RecordKind::of(&view.state).as_str(),
            view.generation,
            view.attempts,
            view.fingerprint.to_hex()
        )
    }
}

impl FromStr for Look {
    type Err = Failure;

    fn from_str(text: &str) -> Result<Self, Failure> {
        let bad = || {
            usage(
                "--look: expected the word `show` printed (state.generation.attempts.fingerprint)",
            )
        };
        let mut parts = text.split('.');
        let (Some(kind_word), Some(generation), Some(attempts), Some(fingerprint), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad());
        };
        let generation = Generation::from_hex(generation).ok_or_else(bad)?;
        let attempts = attempts.parse().map_err(|_| bad())?;
        let fingerprint = Fingerprint::from_hex(fingerprint).ok_or_else(bad)?;
        Ok(Self(Expected::new(
            kind(kind_word)?,
            fingerprint,
            attempts,
            generation,
        )))
    }
}

fn kind(word: &str) -> Result<RecordKind, Failure> {
    [
        RecordKind::InFlight,
        RecordKind::InDoubt,
        RecordKind::Completed,
    ]
    .into_iter()
    .find(|kind| kind.as_str() == word)
    .ok_or_else(|| {
        usage(format!(
            "{word:?} is not a state: in_flight, in_doubt or completed"
        ))
    })
}

fn key(text: &str) -> Result<LedgerKey, Failure> {
    LedgerKey::from_hex(text)
        .ok_or_else(|| usage(format!("{text:?} is not a record key (64 hex digits)")))
}

fn duration(text: &str) -> Result<Duration, Failure> {
    let digits = text.strip_suffix('s').unwrap_or(text);
    digits
        .parse()
        .map(Duration::from_secs)
        .map_err(|_| usage(format!("{text:?} is not a number of seconds")))
}

fn number(text: &str) -> Result<usize, Failure> {
    text.parse()
        .map_err(|_| usage(format!("{text:?} is not a number")))
}

fn seconds(duration: Duration) -> String {
    format!("{}s", duration.as_secs())
}

fn state(state: &RecordState) -> String {
    match state {
        RecordState::InFlight {
            lease_left,
            may_have_been_sent,
        } => format!(
            "in flight, {} of lease left{}",
            seconds(*lease_left),
            if *may_have_been_sent {
                ", may have been sent"
            } else {
                ""
            }
        ),
        RecordState::InDoubt => "in doubt".to_owned(),
        RecordState::Completed { status } => format!("completed, {status}"),
        other => format!("{other:?}"),
    }
}
