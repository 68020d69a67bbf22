{{/* Labels every object of the release carries. */}}
{{- define "stratamq.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The chart's name in the names of its objects: nameOverride, else the chart's. Only
     names follow it: the labels keep the chart's name (the Deployment's selector cannot
     change, and the operator's NetworkPolicies admit its pods by
     app.kubernetes.io/name: stratamq, operator/resources.py OPERATOR_POD_LABELS). */}}
{{- define "stratamq.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object's name: fullnameOverride, else <release>-<name>. Cut to
     44 characters, so that the longest name made from it (<prefix>-operator-uninstall,
     a Job's) stays a 63-character DNS label. Unlike Helm's scaffold, a release name
     that contains the chart's name is not used alone: the names of installs made
     before these overrides existed stay as they were. */}}
{{- define "stratamq.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "stratamq.name" .) | trunc 44 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's name: its ServiceAccount, ClusterRole(Binding), Deployment,
     PriorityClass, disruption budget and peering object are all called this, and the
     hooks' objects after it. */}}
{{- define "stratamq.operatorName" -}}
{{ include "stratamq.fullname" . }}-operator
{{- end -}}

{{/* The ClusterRole the operator binds each storage's Spark driver account to. */}}
{{- define "stratamq.sparkDriverRole" -}}
{{ include "stratamq.fullname" . }}-spark
{{- end -}}

{{/* The job name Prometheus gives the operator's metrics, whatever the objects are
     called: the ServiceMonitor takes it from this label of the Service (its jobLabel),
     and the StratamqOperatorDown alert (rules/stratamq.rules.yaml) selects it. */}}
{{- define "stratamq.operatorMetricsJobLabel" -}}
stratamq.io/metrics-job
{{- end -}}

{{- define "stratamq.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The PriorityClass of the operator's pods: the values' name, else the chart's own. */}}
{{- define "stratamq.operatorPriorityClass" -}}
{{- if .Values.operator.priorityClassName -}}
{{ .Values.operator.priorityClassName }}
{{- else if .Values.operator.priorityClass.create -}}
{{ include "stratamq.operatorName" . }}
{{- end -}}
{{- end -}}

{{/* What the operator's pods and its uninstall hook's pods share (the one image, the
     network, the confinement Pod Security "restricted" asks for, a writable /tmp):
     the hook must run wherever the operator runs. */}}
{{- define "stratamq.operatorImage" -}}
"{{ .Values.operator.image.repository }}:{{ .Values.operator.image.tag | default .Chart.AppVersion }}"
{{- end -}}

{{/* On the node's network, when asked (nodes without a pod network). */}}
{{- define "stratamq.operatorNetwork" -}}
{{- if .Values.operator.hostNetwork -}}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end -}}
{{- end -}}

{{- define "stratamq.operatorPodSecurityContext" -}}
{{ toYaml .Values.operator.podSecurityContext }}
{{- end -}}

{{- define "stratamq.operatorContainerSecurityContext" -}}
{{ toYaml .Values.operator.securityContext }}
{{- end -}}

{{/* The root filesystem is read-only; the Kubernetes client keeps its discovery cache
     under /tmp. */}}
{{- define "stratamq.operatorTmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}

{{/* The operator's rights on what lives in a namespace: granted in every namespace (a
     ClusterRole) or, with operator.watchNamespaces, in those only (a Role each). Each
     rule is one the operator uses (operator/README.md), nothing more. */}}
{{- define "stratamq.operatorNamespacedRules" -}}
# Kopf's events about the storages (and the operator's own).
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
# The resource it reconciles: its handlers' bookkeeping is in annotations (patch),
# what it reports in status.
- apiGroups: [stratamq.io]
  resources: [durablestorages]
  verbs: [get, list, watch, patch]
- apiGroups: [stratamq.io]
  resources: [durablestorages/status]
  verbs: [get, patch]
# Its objects name their storage as owner with blockOwnerDeletion: where the
# OwnerReferencesPermissionEnforcement admission plugin runs, that takes this.
- apiGroups: [stratamq.io]
  resources: [durablestorages/finalizers]
  verbs: [update]
# The replication controller: a ReplicaTransition per planned step, its phase in
# status; listed at an operator start, to know the phases already written; those
# of plans older than spec.transitionHistoryLimit deleted.
- apiGroups: [stratamq.io]
  resources: [replicatransitions]
  verbs: [list, create, delete]
- apiGroups: [stratamq.io]
  resources: [replicatransitions/status]
  verbs: [patch]
# What a storage is made of: server-side apply is a patch that may create.
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, create, patch]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, create, patch]
# A ConfigMap per config, which the pod template names: the older ones deleted once
# no revision of the StatefulSet (a held roll's pods come back from theirs) names
# them; and the Spark executors' pod template (a ConfigMap) once no Spark job is
# enabled.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list, delete]
- apiGroups: [apps]
  resources: [controllerrevisions]
  verbs: [list]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch]
# The admin token Secret: made once, read to call the sites' admin API.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# The sites: their pods (readiness, address: watched for the operator's index of them)
# and volume claims (expansion).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [list, patch]
# The Spark jobs (spec.spark): a CronJob per enabled job (a ScheduledSparkApplication
# where the Spark operator is installed), deleted when the job is turned off; the
# runs they make are watched for status.spark.
- apiGroups: [batch]
  resources: [cronjobs]
  verbs: [get, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch]
- apiGroups: [sparkoperator.k8s.io]
  resources: [scheduledsparkapplications]
  verbs: [get, create, patch, delete]
- apiGroups: [sparkoperator.k8s.io]
  resources: [sparkapplications]
  verbs: [list, watch]
# The Spark driver's account in the storage's namespace, bound to the ClusterRole
# below: `bind` on that one ClusterRole lets the operator grant it without holding
# its rights (it never makes pods itself).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles]
  verbs: [bind]
  resourceNames: [{{ include "stratamq.sparkDriverRole" . }}]
{{- end -}}

{{/* The operator's ServiceAccount: the values' name, else the operator's name. */}}
{{- define "stratamq.operatorServiceAccount" -}}
{{ .Values.operator.serviceAccount.name | default (include "stratamq.operatorName" .) }}
{{- end -}}

{{/* Where the operator's pods run, shared by its hooks' pods (they must run wherever
     it does, and pull its image the same way). */}}
{{- define "stratamq.operatorPodPlacement" -}}
{{- with .Values.operator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The DurableStorage the chart makes (durableStorage.create): the values' name, else
     <release>-mq, apart from the release's own objects. A storage an older chart made
     under the release's name (its default then) keeps that name: a rename would be a
     new storage, the old one and its sites deleted. */}}
{{- define "stratamq.storageName" -}}
{{- if .Values.durableStorage.name -}}
{{ .Values.durableStorage.name }}
{{- else -}}
{{- $made := lookup "stratamq.io/v1alpha1" "DurableStorage" .Release.Namespace .Release.Name -}}
{{- if and $made (eq (dig "metadata" "annotations" "meta.helm.sh/release-name" "" $made) .Release.Name) -}}
{{ .Release.Name }}
{{- else -}}
{{ .Release.Name }}-mq
{{- end -}}
{{- end -}}
{{- end -}}
