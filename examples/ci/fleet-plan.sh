#!/usr/bin/env bash
# A generic CI step for pull requests that touch fleet.yaml: validate offline, then plan against
# the live fleet and keep the plan as an artifact. Exit codes tell the outcomes apart:
#   validate: 0 valid, 3 invalid      plan: 0 no changes, 2 changes, 4 refused (plan errors)
# Needs FLEET_CLUSTER_SECRET from the CI's secret store and a route to the agents.
set -uo pipefail
pip install inference-fleet   # the core install: no torch, no llama.cpp
fleet validate -f fleet.yaml --json > validate.json || { cat validate.json; exit 3; }
fleet plan -f fleet.yaml --detailed-exitcode --json -o plan.json > plan-output.json
rc=$?
case $rc in
  0) echo "no changes" ;;
  2) echo "changes planned: see plan.json"; exit 0 ;;
  *) echo "plan failed with exit $rc"; cat plan-output.json; exit "$rc" ;;
esac
