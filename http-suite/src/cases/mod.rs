//! The cases, one async fn each, grouped by what they prove. The list that names
//! them is in [`scenario_tests!`](crate::scenario_tests).

mod answers;
mod concurrency;
mod drain;
mod keys;
mod scopes;

pub(crate) use answers::*;
pub(crate) use concurrency::*;
pub(crate) use drain::*;
pub(crate) use keys::*;
pub(crate) use scopes::*;
