{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "llm-fleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, plus the chart name unless it already holds it. */}}
{{- define "llm-fleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llm-fleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. component=operator keeps them apart from the serving pods'
     labels (app.kubernetes.io/name: llm-fleet, component: <pool>) that the operator creates. */}}
{{- define "llm-fleet.labels" -}}
helm.sh/chart: {{ include "llm-fleet.chart" . }}
{{ include "llm-fleet.selectorLabels" . }}
app.kubernetes.io/version: {{ include "llm-fleet.versionLabel" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image tag as a label value: a tag may hold up to 128 characters (and a digest "@" and
     ":"), a label value 63 of letters, digits, "-", "_" and ".", starting and ending alphanumeric. */}}
{{- define "llm-fleet.versionLabel" -}}
{{- $tag := include "llm-fleet.tag" .Values.image.tag | default .Chart.AppVersion | toString }}
{{- regexReplaceAll "[^A-Za-z0-9._-]" $tag "_" | trunc 63 | trimAll "-_." }}
{{- end }}

{{- define "llm-fleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-fleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "llm-fleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llm-fleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- /* never the namespace's "default": every pod running as it would get the operator's rights */}}
{{- required "serviceAccount.create=false needs serviceAccount.name: the operator's roles are bound to it" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The llm-fleet image. No default: a default would name an image that may not exist where the
     cluster pulls from, and the pods would sit in ImagePullBackOff. */}}
{{- define "llm-fleet.image" -}}
{{- $tag := include "llm-fleet.tag" .Values.image.tag }}
{{- if not (and .Values.image.repository $tag) }}
{{- fail "image.repository and image.tag are required: the llm-fleet image your cluster can pull, built from the Dockerfile or a release's ghcr.io/<owner>/llm-fleet:<version>-cuda (see docs/cluster-quickstart.md), e.g. --set image.repository=ghcr.io/<owner>/llm-fleet --set image.tag=0.1.0-cuda" }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* An image tag (the context) as a string: YAML and --set make a number of `tag: 20250101`, which
     helm may hold as a float64 and print as 2.0250101e+07; an integral one prints as an integer.
     (A float such as 1.10 has lost its trailing zero already: quote such a tag, or --set-string.)
     Empty where unset. */}}
{{- define "llm-fleet.tag" -}}
{{- if kindIs "float64" . }}
{{- if eq . (floor .) }}{{ printf "%d" (int64 .) }}{{ else }}{{ toString . }}{{ end }}
{{- else if not (kindIs "invalid" .) }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* The image of server pods whose InferenceService sets no spec.image. */}}
{{- define "llm-fleet.serverImage" -}}
{{- .Values.serverImage | default (include "llm-fleet.image" .) }}
{{- end }}

{{/* The operator's RBAC rules, split by scope: generated from llmfleet.operator.deploy.rbac.RBAC_RULES
     into files/rbac-rules.yaml by scripts/chart-sync.py, so the chart never drifts from the code. */}}
{{- define "llm-fleet.rbacRules" -}}
{{- .Files.Get "files/rbac-rules.yaml" }}
{{- end }}
